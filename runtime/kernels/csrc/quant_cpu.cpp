// SPDX-License-Identifier: Apache-2.0
// Products with weights held in a checkpoint's quantized format, dequantized tile by tile
// inside the product (runtime/kernels/quantized_product.py states the formats and holds the
// references that define correctness; cpu_extension.py builds this file with nextn_cpu.cpp).
//
// nextn_cpu::fp8_block_linear(x [M, K], codes [N, K] e4m3, scale [ceil(N/b0), ceil(K/b1)]
// fp32, b0, b1) -> [M, N] in x's dtype.
// nextn_cpu::quantized_grouped_product(x [A, K], codes [G, N, *], scale [G, N, *],
// group_ends [G] int32, fmt, block_k) -> [A, N]: rows sorted by group, group g times expert
// g's weight; fmt "fp8" (codes [G, N, K] e4m3, fp32 scale per row and block_k columns) or
// "mxfp4" (codes [G, N, K/2] two E2M1 codes a byte, E8M0 scale bytes per 32 columns).
//
// Few rows (decode, verify, a routed expert's pairs): each weight row is decoded one scale
// block at a time into fp32, in a buffer in the core's L1 cache, and multiplied into the
// accumulators of every input row; weight rows split over threads. Many rows
// (prefill): panels of 64 weight rows are decoded into fp32 and multiplied by ATen's GEMM,
// so no whole dequantized weight ever exists. Either way the weight's products are exact
// (decoded values times power-of-two or fp32 scales, the reference's numbers); only the
// order of the sums differs from the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kTileN = 16;      // weight rows per thread task of the few-rows path
constexpr int64_t kMaxFewRows = 8;  // rows up to which the few-rows path runs
constexpr int64_t kPanelN = 64;     // weight rows per decoded panel of the many-rows path
constexpr int64_t kMxGroup = 32;
constexpr int64_t kChunk = 512;     // columns decoded at a time (whole scale blocks)

inline uint32_t bits_to_float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e4m3fn byte -> float, in integer selects so that decoding loops vectorize: sign, 4
// exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (mantissa * 2^-9),
// 0x7F / 0xFF NaN.
inline float fp8_value(uint8_t byte) {
  const uint32_t b = byte, em = b & 0x7Fu, sign = (b & 0x80u) << 24;
  const uint32_t normal = sign | ((em << 20) + (120u << 23));
  const uint32_t sub = sign | bits_to_float_bits(static_cast<float>(em) * 0.001953125f);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(em < 8);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(em == 0x7Fu);
  const uint32_t bits = (sub & is_sub) | (normal & ~is_sub);
  return bits_to_float((bits & ~is_nan) | (0x7FC00000u & is_nan));
}

// E2M1 nibble -> float: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0;
// exponent 0 is subnormal (mantissa * 0.5).
inline float e2m1_value(uint32_t nibble) {
  const uint32_t e = (nibble >> 1) & 3u, m = nibble & 1u, sign = (nibble & 8u) << 28;
  const uint32_t normal = sign | ((e + 126u) << 23) | (m << 22);
  const uint32_t sub = sign | bits_to_float_bits(static_cast<float>(m) * 0.5f);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0);
  return bits_to_float((sub & is_sub) | (normal & ~is_sub));
}

float e8m0_value(uint8_t e) {
  return e == 255 ? NAN : std::ldexp(1.0f, static_cast<int>(e) - 127);
}

// Decode `len` weights of row `n` from column `k0` (a multiple of the scale block) into
// `dst`, one scale block at a time.
struct Fp8Rows {
  const uint8_t* codes;  // [N, K]
  const float* scale;    // [ceil(N/b0), KB]
  int64_t K, KB, b0, b1;
  void operator()(int64_t n, int64_t k0, int64_t len, float* dst) const {
    const float* row_scale = scale + (n / b0) * KB;
    for (int64_t c = 0; c < len; c += b1) {
      const float s = row_scale[(k0 + c) / b1];
      const uint8_t* __restrict row = codes + n * K + k0 + c;
      float* __restrict out = dst + c;
      const int64_t width = std::min(b1, len - c);
      for (int64_t k = 0; k < width; ++k) out[k] = fp8_value(row[k]) * s;
    }
  }
};

struct Mxfp4Rows {
  const uint8_t* codes;  // [N, K/2]
  const uint8_t* scale;  // [N, K/32]
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t len, float* dst) const {
    const uint8_t* __restrict row = codes + n * (K / 2) + k0 / 2;
    float* __restrict out = dst;
    for (int64_t k = 0; k < len / 2; ++k) {  // the whole range at once: long loops vectorize
      out[2 * k] = e2m1_value(row[k] & 0x0Fu);
      out[2 * k + 1] = e2m1_value(row[k] >> 4);
    }
    const uint8_t* groups = scale + n * (K / kMxGroup) + k0 / kMxGroup;
    for (int64_t g = 0; g < len / kMxGroup; ++g) {
      const float s = e8m0_value(groups[g]);
      for (int64_t j = 0; j < kMxGroup; ++j) out[g * kMxGroup + j] *= s;
    }
  }
};

// out[m, n] = sum_k x[m, k] W[n, k] for M <= kMaxFewRows. Each weight row is decoded
// kChunk columns at a time into a buffer in L1 and multiplied into every row's kLanes partial
// sums (independent lanes, so the loop vectorizes without reordering any one sum).
template <typename Rows>
void few_rows(const float* x, int64_t M, int64_t N, int64_t K, int64_t block, const Rows& rows,
              float* out, int64_t ldo) {
  constexpr int64_t kLanes = 16;
  at::parallel_for(0, N, kTileN, [&](int64_t first, int64_t last) {
    const int64_t chunk = std::max<int64_t>(block, kChunk / block * block);
    std::vector<float> decoded(chunk + kLanes, 0.0f);
    for (int64_t n = first; n < last; ++n) {
      float acc[kMaxFewRows][kLanes] = {};
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t len = std::min(chunk, K - k0), full = len / kLanes * kLanes;
        rows(n, k0, len, decoded.data());
        for (int64_t m = 0; m < M; ++m) {
          const float* xr = x + m * K + k0;
          float* a = acc[m];
          for (int64_t k = 0; k < full; k += kLanes)
            for (int64_t l = 0; l < kLanes; ++l) a[l] += xr[k + l] * decoded[k + l];
          for (int64_t k = full; k < len; ++k) a[k - full] += xr[k] * decoded[k];
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        float sum = 0.0f;
        for (int64_t l = 0; l < kLanes; ++l) sum += acc[m][l];
        out[m * ldo + n] = sum;
      }
    }
  });
}

#if defined(__AVX512F__)
// 16 e4m3 codes -> their values * 2^-8: each code's bits moved into an fp16's (sign; the 4
// exponent bits into the low exponent bits, the 3 mantissa bits on top of the mantissa) give
// the same number with exponent bias 15 instead of 7, subnormals included, and the hardware
// widens fp16 exactly. NaN codes are refused at load (they would decode as finite).
inline __m512 fp8x16_down8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
}

// 16 bytes = 32 E2M1 codes (low nibble first) -> their values * 2^-14, the same way (bias 1
// -> 15): values 0..15 in `lo`, 16..31 in `hi`.
inline void mxfp4x32_down14(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i pairs = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF0)), 12));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(pairs, _mm512_set1_epi32(0x00080008)), 12);
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(pairs, _mm512_set1_epi32(0x00070007)), 9);
  const __m512i bits = _mm512_or_si512(sign, mag);
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
}

inline void fma_rows(const float* x, int64_t ldx, int64_t M, int64_t k, __m512 w, __m512* acc) {
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), w, acc[m]);
}

// few_rows with decoding fused into the products (AVX-512): each 16 / 32 codes are decoded
// in registers, scaled exactly, and multiplied into every input row's accumulator.
bool few_rows_fused(const float* x, int64_t M, int64_t N, int64_t K, const Fp8Rows& rows,
                    float* out, int64_t ldo) {
  if (rows.b1 % 16 || K % 16) return false;
  at::parallel_for(0, N, kTileN, [&](int64_t first, int64_t last) {
    const __m512 up8 = _mm512_set1_ps(256.0f);
    for (int64_t n = first; n < last; ++n) {
      __m512 acc[kMaxFewRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      const uint8_t* row = rows.codes + n * K;
      const float* row_scale = rows.scale + (n / rows.b0) * rows.KB;
      for (int64_t k0 = 0, kb = 0; k0 < K; k0 += rows.b1, ++kb) {
        const __m512 s = _mm512_set1_ps(row_scale[kb]);
        const int64_t end = std::min(K, k0 + rows.b1);
        for (int64_t k = k0; k < end; k += 16) {
          const __m512 w = _mm512_mul_ps(_mm512_mul_ps(fp8x16_down8(row + k), up8), s);
          fma_rows(x, K, M, k, w, acc);
        }
      }
      for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
    }
  });
  return true;
}

bool few_rows_fused(const float* x, int64_t M, int64_t N, int64_t K, const Mxfp4Rows& rows,
                    float* out, int64_t ldo) {
  at::parallel_for(0, N, kTileN, [&](int64_t first, int64_t last) {
    const __m512 up14 = _mm512_set1_ps(16384.0f);
    for (int64_t n = first; n < last; ++n) {
      __m512 acc[kMaxFewRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      const uint8_t* row = rows.codes + n * (K / 2);
      const uint8_t* groups = rows.scale + n * (K / kMxGroup);
      for (int64_t g = 0; g < K / kMxGroup; ++g) {
        const __m512 s = _mm512_set1_ps(e8m0_value(groups[g]));
        __m512 lo, hi;
        mxfp4x32_down14(row + g * (kMxGroup / 2), &lo, &hi);
        fma_rows(x, K, M, g * kMxGroup, _mm512_mul_ps(_mm512_mul_ps(lo, up14), s), acc);
        fma_rows(x, K, M, g * kMxGroup + 16, _mm512_mul_ps(_mm512_mul_ps(hi, up14), s), acc);
      }
      for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
    }
  });
  return true;
}
#else
template <typename Rows>
bool few_rows_fused(const float*, int64_t, int64_t, int64_t, const Rows&, float*, int64_t) {
  return false;
}
#endif

// The same product for many rows: decoded panels of kPanelN weight rows through ATen's GEMM.
template <typename Rows>
void many_rows(const at::Tensor& x, int64_t N, int64_t K, int64_t block, const Rows& rows,
               at::Tensor out) {
  at::Tensor panel = at::empty({std::min(kPanelN, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += kPanelN) {
    const int64_t nt = std::min(kPanelN, N - n0);
    float* p = panel.data_ptr<float>();
    at::parallel_for(0, nt, 4, [&](int64_t first, int64_t last) {
      for (int64_t n = first; n < last; ++n) rows(n0 + n, 0, K, p + n * K);
    });
    out.narrow(1, n0, nt).copy_(at::mm(x, panel.narrow(0, 0, nt).t()));
  }
}

template <typename Rows>
void product(const at::Tensor& x, int64_t N, int64_t block, const Rows& rows, at::Tensor out) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
  if (M <= kMaxFewRows) {
    float* o = out.data_ptr<float>();
    if (!few_rows_fused(x.data_ptr<float>(), M, N, K, rows, o, out.stride(0)))
      few_rows(x.data_ptr<float>(), M, N, K, block, rows, o, out.stride(0));
  } else {
    many_rows(x, N, K, block, rows, out);
  }
}

// x [M, K] with codes [N, K], or a batch: x [G, M, K] with codes [G, N, K] and scale
// [G, ceil(N/b0), KB] (DeepSeek-V4's grouped wo_a).
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            int64_t b0, int64_t b1) {
  const bool batched = codes.dim() == 3;
  TORCH_CHECK((codes.dim() == 2 || batched) && x.dim() == codes.dim() && scale.dim() == codes.dim() &&
                  x.size(-1) == codes.size(-1) && (!batched || x.size(0) == codes.size(0)),
              "fp8_block_linear: x [M, K] with codes [N, K], or x [G, M, K] with codes [G, N, K]");
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn, "fp8_block_linear: e4m3 codes expected");
  const int64_t N = codes.size(-2), K = codes.size(-1), G = batched ? codes.size(0) : 1;
  TORCH_CHECK(b0 >= 1 && b1 >= 1 && scale.scalar_type() == at::kFloat &&
                  scale.size(-2) == (N + b0 - 1) / b0 && scale.size(-1) == (K + b1 - 1) / b1,
              "fp8_block_linear: scale [ceil(N/b0), ceil(K/b1)] float32 expected");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor c = codes.contiguous().view(at::kByte), s = scale.contiguous();
  const int64_t M = x.size(-2), KB = s.size(-1), SR = s.size(-2);
  at::Tensor out = at::empty(batched ? at::IntArrayRef{G, M, N} : at::IntArrayRef{M, N},
                             xf.options());
  for (int64_t g = 0; g < G; ++g) {
    Fp8Rows rows{c.data_ptr<uint8_t>() + g * N * K, s.data_ptr<float>() + g * SR * KB, K, KB, b0,
                 b1};
    product(batched ? xf[g] : xf, N, b1, rows, batched ? out[g] : out);
  }
  return out.to(x.scalar_type());
}

at::Tensor quantized_grouped_product(const at::Tensor& x, const at::Tensor& codes,
                                     const at::Tensor& scale, const at::Tensor& group_ends,
                                     c10::string_view fmt, int64_t block_k) {
  const bool mx = fmt == "mxfp4";
  TORCH_CHECK(mx || fmt == "fp8", "quantized_grouped_product: fmt must be fp8 or mxfp4");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scale.dim() == 3,
              "quantized_grouped_product: x [A, K], codes and scale [G, N, *] expected");
  const int64_t G = codes.size(0), N = codes.size(1), K = x.size(1);
  TORCH_CHECK(codes.size(2) == (mx ? K / 2 : K) && group_ends.numel() == G,
              "quantized_grouped_product: codes do not match x's width or the groups");
  if (mx) {
    TORCH_CHECK(K % kMxGroup == 0 && scale.scalar_type() == at::kByte &&
                    scale.size(2) == K / kMxGroup && codes.scalar_type() == at::kByte,
                "quantized_grouped_product: mxfp4 needs uint8 codes and E8M0 scale bytes");
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat &&
                    scale.size(2) == (K + block_k - 1) / block_k,
                "quantized_grouped_product: fp8 needs e4m3 codes and float32 scales");
  }
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor c = codes.contiguous().view(at::kByte), s = scale.contiguous();
  at::Tensor ends = group_ends.to(at::kLong).cpu();
  at::Tensor out = at::zeros({x.size(0), N}, xf.options());
  const int64_t* e = ends.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t end = e[g];
    if (end > start) {
      at::Tensor xs = xf.narrow(0, start, end - start), os = out.narrow(0, start, end - start);
      if (mx) {
        const int64_t per = N * (K / 2), per_s = N * (K / kMxGroup);
        Mxfp4Rows rows{c.data_ptr<uint8_t>() + g * per, s.data_ptr<uint8_t>() + g * per_s, K};
        product(xs, N, kMxGroup, rows, os);
      } else {
        const int64_t KB = s.size(2);
        Fp8Rows rows{c.data_ptr<uint8_t>() + g * N * K, s.data_ptr<float>() + g * N * KB, K, KB,
                     1, block_k};
        product(xs, N, block_k, rows, os);
      }
    }
    start = end;
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def("fp8_block_linear(Tensor x, Tensor codes, Tensor scale, int b0, int b1) -> Tensor");
  m.def(
      "quantized_grouped_product(Tensor x, Tensor codes, Tensor scale, Tensor group_ends, "
      "str fmt, int block_k) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) {
  m.impl("fp8_block_linear", &fp8_block_linear);
  m.impl("quantized_grouped_product", &quantized_grouped_product);
}
