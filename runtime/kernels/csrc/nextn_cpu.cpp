// SPDX-License-Identifier: Apache-2.0
// The project's C++ CPU kernels (runtime/kernels/cpu_extension.py builds and loads them).
//
// nextn_cpu::narrow_product: out[g] = x[g] @ weight[index[g]]^T for a few rows, reading the
// bf16 weight once and widening it in registers (runtime/kernels/narrow_product.py).
// x [G, M, K] fp32, weight [E, N, K] bf16, index [G] int64 -> out [G, M, N] fp32.
// Each block of weight rows is loaded and widened once per K chunk and multiplied into
// the accumulators of every input row that reads it (up to 8 per pass, all groups with
// the same index together), so extra rows cost arithmetic, not bytes. Built for the
// instruction set torch dispatches to (AVX-512 or AVX2); without either, a scalar loop.
//
// nextn_cpu::indexer_topk: runtime/kernels/indexer_topk.py's op body as ATen calls.
//
// nextn_cpu::hc_pre, hc_post and sinkhorn: mHC's collapse of the streams (mixing weights,
// Sinkhorn and the weighted sum in one call), stream expansion and Sinkhorn normalisation,
// eager and in captured steps (runtime/kernels/hc_pre.py, stream_expand.py, sinkhorn.py).
//
// nextn_cpu::rms_norm and swiglu: RMSNorm and the clamped SwiGLU of fp32 rows in one pass
// (runtime/kernels/rms_norm.py, swiglu.py).
//
// nextn_cpu::tile_product, tile_ready: fp32 rows times a bf16 weight on AMX
// tiles, each row split into three bf16 parts so that every product is exact
// (runtime/kernels/tile_product.py).
//
// nextn_cpu::dense_product: fp32 rows times an fp32 weight through oneDNN's GEMM (ATen's
// mkldnn::_linear_pointwise reached through the dispatcher), where it beats the default
// BLAS (runtime/kernels/dense_product.py).
//
// nextn_cpu::tile_attention: eager prefill's attention of a tile of rows over its shared
// keys, all heads in one GEMM per tile (runtime/kernels/sink_attention.py).
//
// nextn_cpu::group_attention: a uniform step's attention, each request's rows and heads
// over its shared keys (and each row's own selected keys) in one pass per request
// (runtime/kernels/sink_attention.py).
//
// nextn_cpu::merge_row_keys: a prefill row's own selected keys (DeepSeek-V4 CSA) merged
// into its attention over its tile's keys, the keys read straight from the cache
// (runtime/kernels/sink_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define NARROW_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NARROW_AVX2 1
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // rows per pass: accumulators must fit the registers

#if defined(NARROW_AVX512)
// 16 lanes; a block of `Cols` weight rows times `M` input rows
constexpr int64_t kLanes = 16;
using VecF = __m512;
inline VecF widen(const uint16_t* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline VecF widen_tail(const uint16_t* p, int64_t count) {
  __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
  __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline VecF load(const float* p) { return _mm512_loadu_ps(p); }
inline VecF load_tail(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), p);
}
inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(VecF v) { return _mm512_reduce_add_ps(v); }
#elif defined(NARROW_AVX2)
constexpr int64_t kLanes = 8;
using VecF = __m256;
inline VecF widen(const uint16_t* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline VecF widen_tail(const uint16_t* p, int64_t count) {
  alignas(32) uint16_t buf[8] = {0};
  std::memcpy(buf, p, count * sizeof(uint16_t));
  return widen(buf);
}
inline VecF load(const float* p) { return _mm256_loadu_ps(p); }
inline VecF load_tail(const float* p, int64_t count) {
  alignas(32) float buf[8] = {0};
  std::memcpy(buf, p, count * sizeof(float));
  return _mm256_loadu_ps(buf);
}
inline VecF zero() { return _mm256_setzero_ps(); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(VecF v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

#if defined(NARROW_AVX512)
// lane l of the result: the sum of src[l]'s 16 lanes (l < 16), for four shuffles and an
// addition per pair of vectors instead of a reduction per vector. The lanes are added in
// the pairs of _mm512_reduce_add_ps (i and i + 8, then i + 4, i + 2, i + 1), so every sum
// has the bits `hsum` gives it. Inputs enter as v[4j + q] = src[4q + j], which the
// quarter-wise steps below leave in lane 4q + j.
inline __m512 reduce16(const __m512* src) {
  auto v = [src](int i) { return src[4 * (i % 4) + i / 4]; };
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes i + 8 onto i: sources 2i, 2i + 1 in 256-bit halves
    const __m512 x = v(2 * i), y = v(2 * i + 1);
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // i + 4 onto i: four sources in the 128-bit quarters
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // i + 2 onto i, within each quarter
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]),
                         _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),  // i + 1 onto i
                       _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

#if defined(NARROW_AVX512) || defined(NARROW_AVX2)
// out rows `o[m]` (columns n0 .. n0 + Cols) for the `M` input rows `x[m]` (compile-time,
// so the accumulators stay in registers) and the `Cols` weight rows from `w`. With
// `prefetch_next` the next block's rows are prefetched while this one is multiplied (one
// 64-byte line per row every 32 values): the weights stream from the shared cache, and the
// hardware prefetcher alone left each block waiting for its loads (a 4-row product of a
// 4096 x 256 weight took 138 against 106 us without it, one thread; same results).
template <int M, int Cols>
inline void block(const float* const* x, const uint16_t* w, int64_t K, float* const* o,
                  int64_t n0, bool prefetch_next) {
  VecF acc[M][Cols];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < Cols; ++c) acc[m][c] = zero();
  int64_t k = 0;
  const uint16_t* next = w + Cols * K;
  for (; k + kLanes <= K; k += kLanes) {
    VecF wv[Cols];
    for (int c = 0; c < Cols; ++c) wv[c] = widen(w + c * K + k);
    if (prefetch_next && k % 32 == 0)
      for (int c = 0; c < Cols; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(next + c * K + k), _MM_HINT_T0);
    for (int m = 0; m < M; ++m) {
      VecF xv = load(x[m] + k);
      for (int c = 0; c < Cols; ++c) acc[m][c] = fma(wv[c], xv, acc[m][c]);
    }
  }
  if (k < K) {
    const int64_t rest = K - k;
    VecF wv[Cols];
    for (int c = 0; c < Cols; ++c) wv[c] = widen_tail(w + c * K + k, rest);
    for (int m = 0; m < M; ++m) {
      VecF xv = load_tail(x[m] + k, rest);
      for (int c = 0; c < Cols; ++c) acc[m][c] = fma(wv[c], xv, acc[m][c]);
    }
  }
#if defined(NARROW_AVX512)
  if constexpr (M * Cols >= 8) {  // all sums in one reduction, the same bits as `hsum`
    __m512 src[16];
    for (int i = 0; i < 16; ++i) src[i] = i < M * Cols ? acc[i / Cols][i % Cols] : zero();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(src));
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < Cols; ++c) o[m][n0 + c] = sums[m * Cols + c];
    return;
  }
#endif
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < Cols; ++c) o[m][n0 + c] = hsum(acc[m][c]);
}

template <int M>
void rows_times_weight(const float* const* x, const uint16_t* w, int64_t K, float* const* o,
                       int64_t n_begin, int64_t n_end, int64_t n_rows) {
  // at most 16 accumulators, so more weight rows per pass for fewer input rows
  constexpr int Cols = M <= 4 ? 4 : 2;
  int64_t n = n_begin;
  for (; n + Cols <= n_end; n += Cols)
    block<M, Cols>(x, w + n * K, K, o, n, n + 2 * Cols <= n_rows);
  for (; n < n_end; ++n) block<M, 1>(x, w + n * K, K, o, n, n + 2 <= n_rows);
}
#else
inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

template <int M>
void rows_times_weight(const float* const* x, const uint16_t* w, int64_t K, float* const* o,
                       int64_t n_begin, int64_t n_end, int64_t /*n_rows*/) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += bf16_to_float(w[n * K + k]) * x[m][k];
      o[m][n] = acc;
    }
}
#endif

// (x rows, weight, K, out rows, first and end weight row of the task, weight rows in all)
using Kernel = void (*)(const float* const*, const uint16_t*, int64_t, float* const*, int64_t,
                        int64_t, int64_t);

Kernel kernel_for(int64_t rows) {
  switch (rows) {
    case 1: return rows_times_weight<1>;
    case 2: return rows_times_weight<2>;
    case 3: return rows_times_weight<3>;
    case 4: return rows_times_weight<4>;
    case 5: return rows_times_weight<5>;
    case 6: return rows_times_weight<6>;
    case 7: return rows_times_weight<7>;
    default: return rows_times_weight<8>;
  }
}

// x [G, M, K] fp32; weight [E, N, K] bf16; index [G] int64 (group g reads weight[index[g]])
// or none (E == G: group g reads weight[g]; E == 1: every group reads weight[0]).
// Groups that read the same weight are served together, so each weight is read once.
at::Tensor narrow_product(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& index) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3,
              "narrow_product: x [G, M, K] and weight [E, N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "narrow_product: x must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "narrow_product: weight must be bfloat16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "narrow_product: CPU only");
  const int64_t G = x.size(0), M = x.size(1), K = x.size(2);
  const int64_t E = weight.size(0), N = weight.size(1);
  TORCH_CHECK(weight.size(2) == K, "narrow_product: x and weight differ in K");
  at::Tensor out = at::empty({G, M, N}, x.options());
  if (G == 0 || M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  std::vector<int64_t> expert(G);
  if (index.has_value()) {
    at::Tensor ic = index->to(at::kLong).contiguous();
    TORCH_CHECK(ic.dim() == 1 && ic.size(0) == G, "narrow_product: index must be [G]");
    const int64_t* ip = ic.data_ptr<int64_t>();
    for (int64_t g = 0; g < G; ++g) {
      TORCH_CHECK(ip[g] >= 0 && ip[g] < E, "narrow_product: index out of range");
      expert[g] = ip[g];
    }
  } else {
    TORCH_CHECK(E == G || E == 1, "narrow_product: without index, E must be G or 1");
    for (int64_t g = 0; g < G; ++g) expert[g] = E == 1 ? 0 : g;
  }
  // the input and output rows of each distinct weight, in order of first use
  std::vector<int64_t> order(G);
  for (int64_t g = 0; g < G; ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return expert[a] < expert[b]; });
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<const float*> xrows;
  std::vector<float*> orows;
  std::vector<int64_t> run_expert, run_start;  // run r: rows run_start[r] .. run_start[r+1]
  for (int64_t i = 0; i < G; ++i) {
    const int64_t g = order[i];
    if (i == 0 || expert[g] != expert[order[i - 1]]) {
      run_expert.push_back(expert[g]);
      run_start.push_back(static_cast<int64_t>(xrows.size()));
    }
    for (int64_t m = 0; m < M; ++m) {
      xrows.push_back(xp + (g * M + m) * K);
      orows.push_back(op + (g * M + m) * N);
    }
  }
  run_start.push_back(static_cast<int64_t>(xrows.size()));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  const int64_t runs = static_cast<int64_t>(run_expert.size());
  const int64_t slice = 64;  // weight rows per task
  const int64_t slices = (N + slice - 1) / slice;
  at::parallel_for(0, runs * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / slices, s = item % slices;
      const int64_t n0 = s * slice, n1 = std::min(N, n0 + slice);
      const uint16_t* w = wp + run_expert[r] * N * K;
      for (int64_t row = run_start[r]; row < run_start[r + 1]; row += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, run_start[r + 1] - row);
        kernel_for(rows)(xrows.data() + row, w, K, orows.data() + row, n0, n1, N);
      }
    }
  });
  return out;
}

// nextn::indexer_topk's body (runtime/kernels/indexer_topk.py) as ATen calls, so that a
// compiled step calls it without Python: the same operations in the same order, so the
// same indices, ties included.
std::tuple<at::Tensor, at::Tensor> indexer_topk(const at::Tensor& scores,
                                                const at::Tensor& lengths,
                                                const at::Tensor& visible, int64_t k) {
  const int64_t rows = scores.size(0), width = scores.size(1);
  if (width <= k) {  // everything fits: the selection is every entry (padded to k)
    at::Tensor indices =
        at::arange(k, scores.options().dtype(at::kLong)).expand({rows, k}).contiguous();
    return {indices, indices.lt(visible.unsqueeze(1))};
  }
  auto top = scores.topk(k + 1, 1);
  at::Tensor values = std::get<0>(top);
  at::Tensor indices = std::get<1>(top).narrow(1, 0, k).contiguous();
  at::Tensor tied = values.select(1, k - 1).eq(values.select(1, k)).logical_and(visible.gt(k));
  if (tied.any().item<bool>()) {
    at::Tensor tied_rows = tied.nonzero().squeeze(1);
    at::Tensor tied_lengths = lengths.index_select(0, tied_rows);
    at::Tensor unique = std::get<0>(at::_unique(tied_lengths, /*sorted=*/true));
    auto* first = unique.to(at::kLong).contiguous().data_ptr<int64_t>();
    for (int64_t i = 0; i < unique.numel(); ++i) {
      const int64_t length = first[i];
      at::Tensor group = tied_rows.masked_select(tied_lengths.eq(length));
      at::Tensor picked = std::get<1>(scores.index_select(0, group).narrow(1, 0, length).topk(k, 1));
      indices.index_put_({group}, picked);
    }
  }
  indices = std::get<0>(indices.sort(1));
  return {indices, indices.lt(visible.unsqueeze(1))};
}

// mHC's stream expansion (runtime/kernels/hyper_mix.py): out[t, o] = post[t, o] * block[t]
// + sum_i comb[t, i, o] * residual[t, i], one pass over the streams per token, the sum in
// fp32 in the order i = 0, 1, ... and the block's term last (as the torch form: a batched
// product, then addcmul). block [T, H], residual [T, S, H] (fp32 or bf16, one dtype),
// post [T, S] and comb [T, S, S] fp32 -> [T, S, H] in the residual's dtype.
template <typename scalar_t>
void expand_streams(const scalar_t* block, const scalar_t* residual, const float* post,
                    const float* comb, scalar_t* out, int64_t T, int64_t S, int64_t H) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    float* a = acc.data();
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* b = block + t * H;
      const scalar_t* r = residual + t * S * H;
      const float* c = comb + t * S * S;
      for (int64_t o = 0; o < S; ++o) {
        const float c0 = c[o];
        for (int64_t h = 0; h < H; ++h) a[h] = c0 * static_cast<float>(r[h]);
        for (int64_t i = 1; i < S; ++i) {
          const float ci = c[i * S + o];
          const scalar_t* ri = r + i * H;
          for (int64_t h = 0; h < H; ++h) a[h] += ci * static_cast<float>(ri[h]);
        }
        const float p = post[t * S + o];
        scalar_t* dst = out + (t * S + o) * H;
        for (int64_t h = 0; h < H; ++h)
          dst[h] = static_cast<scalar_t>(a[h] + p * static_cast<float>(b[h]));
      }
    }
  });
}

at::Tensor hc_post(const at::Tensor& block, const at::Tensor& residual, const at::Tensor& post,
                   const at::Tensor& comb) {
  TORCH_CHECK(residual.dim() == 3 && block.dim() == 2,
              "hc_post: residual [T, S, H], block [T, H]");
  const int64_t T = residual.size(0), S = residual.size(1), H = residual.size(2);
  TORCH_CHECK(block.size(0) == T && block.size(1) == H, "hc_post: block must be [T, H]");
  TORCH_CHECK(post.dim() == 2 && post.size(0) == T && post.size(1) == S && comb.dim() == 3 &&
                  comb.size(0) == T && comb.size(1) == S && comb.size(2) == S,
              "hc_post: post [T, S], comb [T, S, S]");
  TORCH_CHECK(block.scalar_type() == residual.scalar_type(),
              "hc_post: block and residual differ in dtype");
  TORCH_CHECK(post.scalar_type() == at::kFloat && comb.scalar_type() == at::kFloat,
              "hc_post: post and comb must be float32");
  at::Tensor out = at::empty({T, S, H}, residual.options());
  if (out.numel() == 0) return out;
  at::Tensor bc = block.contiguous(), rc = residual.contiguous();
  at::Tensor pc = post.contiguous(), cc = comb.contiguous();
  if (residual.scalar_type() == at::kFloat) {
    expand_streams<float>(bc.data_ptr<float>(), rc.data_ptr<float>(), pc.data_ptr<float>(),
                          cc.data_ptr<float>(), out.data_ptr<float>(), T, S, H);
  } else if (residual.scalar_type() == at::kBFloat16) {
    expand_streams<at::BFloat16>(bc.data_ptr<at::BFloat16>(), rc.data_ptr<at::BFloat16>(),
                                 pc.data_ptr<float>(), cc.data_ptr<float>(),
                                 out.data_ptr<at::BFloat16>(), T, S, H);
  } else {
    TORCH_CHECK(false, "hc_post: float32 or bfloat16 streams");
  }
  return out;
}

// runtime/kernels/sink_attention.py's merge of each row's own keys (DeepSeek-V4 CSA in
// eager prefill) into its tile attention: for row t and head h, with z_j = scale q.k_j over
// the row's valid keys k_j = source[index[t, j]], l = tile_lse[t, h] and s = sink[h]:
//   L = log(exp(l) + sum_j exp(z_j) + exp(s))
//   out = tile_out * exp(l - L) + sum_j exp(z_j - L) k_j
// The keys are read from the cache where they lie (no gathered [T, Kr, D] copy written and
// read back), the next row's keys prefetched while this row's are used. Statistics and
// sums in fp32; only the order of the sums differs from the torch form.
inline float dot_lanes(const float* a, const float* b, int64_t D) {
  constexpr int64_t L = 16;
  float lanes[L] = {};
  int64_t d = 0;
  for (; d + L <= D; d += L)
    for (int64_t l = 0; l < L; ++l) lanes[l] += a[d + l] * b[d + l];
  for (int64_t w = L / 2; w >= 1; w /= 2)  // a tree, not a chain of 16 dependent additions
    for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  float s = lanes[0];
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

#if defined(NARROW_AVX512)
// exp on 16 lanes: 2^n exp(r), n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts),
// exp(r) by its Taylor polynomial to r^7 (|r| <= ln 2 / 2: within 2 ulp of expf). Inputs
// below -110 (-inf included) give exactly 0.
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// z[i] <- exp(z[i] - top) for i < n; returns `sum` plus theirs (16 lanes at a time on
// AVX-512, added to `sum` once; one by one otherwise)
inline float exp_shifted_sum(float* z, int64_t n, float top, float sum) {
#if defined(NARROW_AVX512)
  __m512 sums = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
    const __m512 z_top = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, z + i), _mm512_set1_ps(top));
    const __m512 e = exp_lanes(z_top);
    _mm512_mask_storeu_ps(z + i, m, e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(m, e));
  }
  return sum + _mm512_reduce_add_ps(sums);
#else
  for (int64_t i = 0; i < n; ++i) {
    z[i] = std::exp(z[i] - top);
    sum += z[i];
  }
  return sum;
#endif
}

#if defined(NARROW_AVX512)
// merge_heads for D = 16 NV: the query, the accumulators and each key in NV registers
template <int NV>
inline void merge_heads_lanes(const float* q, const float* const* keys, int64_t n,
                              const float* tile_out, const float* tile_lse, const float* sink,
                              float scale, float* out, int64_t H, float* z) {
  constexpr int64_t D = 16 * NV;
  for (int64_t h = 0; h < H; ++h) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(q + h * D + 16 * v);
    const float l = tile_lse[h], s = sink[h];
    float top = std::max(l, s);
    for (int64_t i = 0; i < n; ++i) {
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[i]));
      for (int v = 1; v < NV; ++v)
        acc = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(keys[i] + 16 * v), acc);
      z[i] = _mm512_reduce_add_ps(acc) * scale;
      top = std::max(top, z[i]);
    }
    const float el = std::exp(l - top);
    const float inv = 1.0f / exp_shifted_sum(z, n, top, el + std::exp(s - top));
    __m512 acc[NV];
    const __m512 w = _mm512_set1_ps(el * inv);
    for (int v = 0; v < NV; ++v)
      acc[v] = _mm512_mul_ps(_mm512_loadu_ps(tile_out + h * D + 16 * v), w);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(z[j] * inv);
      for (int v = 0; v < NV; ++v)
        acc[v] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(keys[j] + 16 * v), acc[v]);
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + h * D + 16 * v, acc[v]);
  }
}
#endif

// one row's heads: scores of its n valid keys, the merge through the log-sum-exp
inline void merge_heads(const float* q, const float* const* keys, int64_t n,
                        const float* tile_out, const float* tile_lse, const float* sink,
                        float scale, float* out, int64_t H, int64_t D, float* z) {
#if defined(NARROW_AVX512)
  switch (D) {
    case 16: return merge_heads_lanes<1>(q, keys, n, tile_out, tile_lse, sink, scale, out, H, z);
    case 32: return merge_heads_lanes<2>(q, keys, n, tile_out, tile_lse, sink, scale, out, H, z);
    case 64: return merge_heads_lanes<4>(q, keys, n, tile_out, tile_lse, sink, scale, out, H, z);
    case 128: return merge_heads_lanes<8>(q, keys, n, tile_out, tile_lse, sink, scale, out, H, z);
    default: break;
  }
#endif
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * D;
    const float l = tile_lse[h], s = sink[h];
    float top = std::max(l, s);
    for (int64_t i = 0; i < n; ++i) {
      z[i] = dot_lanes(qh, keys[i], D) * scale;
      top = std::max(top, z[i]);
    }
    const float el = std::exp(l - top);
    const float inv = 1.0f / exp_shifted_sum(z, n, top, el + std::exp(s - top));
    const float w = el * inv;
    const float* o = tile_out + h * D;
    float* dst = out + h * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * w;
    for (int64_t j = 0; j < n; ++j) {
      const float pj = z[j] * inv;
      const float* k = keys[j];
      for (int64_t d = 0; d < D; ++d) dst[d] += pj * k[d];
    }
  }
}

template <typename src_t>
void merge_row_keys_rows(const float* q, const src_t* source, const int64_t* index,
                         const bool* valid, const float* tile_out, const float* tile_lse,
                         const float* sink, float scale, float* out, int64_t T, int64_t H,
                         int64_t D, int64_t Kr) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same<src_t, float>::value ? 0 : Kr * D);
    std::vector<const float*> keys(Kr);
    std::vector<float> z(Kr + 16);
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(src_t));
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {
        for (int64_t j = 0; j < Kr; ++j) {
          if (!valid[(t + 1) * Kr + j]) continue;
          const char* row = reinterpret_cast<const char*>(source + index[(t + 1) * Kr + j] * D);
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
        }
      }
      int64_t n = 0;
      for (int64_t j = 0; j < Kr; ++j) {
        if (!valid[t * Kr + j]) continue;
        const src_t* row = source + index[t * Kr + j] * D;
        if constexpr (std::is_same<src_t, float>::value) {
          keys[n] = row;
        } else {
          float* w = widened.data() + n * D;
          for (int64_t d = 0; d < D; ++d) w[d] = static_cast<float>(row[d]);
          keys[n] = w;
        }
        ++n;
      }
      merge_heads(q + t * H * D, keys.data(), n, tile_out + t * H * D, tile_lse + t * H, sink,
                  scale, out + t * H * D, H, D, z.data());
    }
  });
}

at::Tensor merge_row_keys(const at::Tensor& tile_out, const at::Tensor& tile_lse,
                          const at::Tensor& q, const at::Tensor& source, const at::Tensor& index,
                          const at::Tensor& valid, const at::Tensor& sink, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat,
              "merge_row_keys: q [T, H, D] fp32");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(tile_out.sizes() == q.sizes() && tile_out.scalar_type() == at::kFloat,
              "merge_row_keys: tile_out [T, H, D] fp32");
  TORCH_CHECK(tile_lse.dim() == 2 && tile_lse.size(0) == T && tile_lse.size(1) == H &&
                  tile_lse.scalar_type() == at::kFloat,
              "merge_row_keys: tile_lse [T, H] fp32");
  TORCH_CHECK(source.dim() == 2 && source.size(1) == D &&
                  (source.scalar_type() == at::kFloat || source.scalar_type() == at::kBFloat16),
              "merge_row_keys: source [P, D] fp32 or bf16");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == T && index.scalar_type() == at::kLong,
              "merge_row_keys: index [T, Kr] int64");
  TORCH_CHECK(valid.sizes() == index.sizes() && valid.scalar_type() == at::kBool,
              "merge_row_keys: valid [T, Kr] bool");
  TORCH_CHECK(sink.dim() == 1 && sink.size(0) == H && sink.scalar_type() == at::kFloat,
              "merge_row_keys: sink [H] fp32");
  const int64_t Kr = index.size(1), P = source.size(0);
  at::Tensor ic = index.contiguous(), vc = valid.contiguous();
  // a key outside the cache would be read out of bounds: refuse it (masked entries too,
  // so that the check needs no mask)
  if (ic.numel() > 0) {
    TORCH_CHECK(ic.min().item<int64_t>() >= 0 && ic.max().item<int64_t>() < P,
                "merge_row_keys: index out of the source's rows");
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  if (out.numel() == 0) return out;
  at::Tensor qc = q.contiguous(), oc = tile_out.contiguous(), lc = tile_lse.contiguous();
  at::Tensor sc = source.contiguous(), kc = sink.contiguous();
  const float sc_f = static_cast<float>(scale);
  if (source.scalar_type() == at::kFloat) {
    merge_row_keys_rows<float>(qc.data_ptr<float>(), sc.data_ptr<float>(),
                               ic.data_ptr<int64_t>(), vc.data_ptr<bool>(), oc.data_ptr<float>(),
                               lc.data_ptr<float>(), kc.data_ptr<float>(), sc_f,
                               out.data_ptr<float>(), T, H, D, Kr);
  } else {
    merge_row_keys_rows<at::BFloat16>(
        qc.data_ptr<float>(), sc.data_ptr<at::BFloat16>(), ic.data_ptr<int64_t>(),
        vc.data_ptr<bool>(), oc.data_ptr<float>(), lc.data_ptr<float>(), kc.data_ptr<float>(),
        sc_f, out.data_ptr<float>(), T, H, D, Kr);
  }
  return out;
}

// runtime/kernels/rms_norm.py's RMSNorm of fp32 rows: x * rsqrt(mean(x^2) + eps), times
// the weight where there is one, in that order (as the torch form: two roundings); one
// read and one write per row instead of the torch form's four passes. The sum of squares
// in 16 lanes summed as a tree: only its order differs from torch's mean.
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "rms_norm: fp32 x [..., D]");
  const int64_t D = x.size(-1);
  TORCH_CHECK(!weight.has_value() || (weight->dim() == 1 && weight->size(0) == D &&
                                       weight->scalar_type() == at::kFloat),
              "rms_norm: weight must be [D] fp32");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = D == 0 ? 0 : xc.numel() / D;
  if (rows == 0) return out;
  at::Tensor wc = weight.has_value() ? weight->contiguous() : at::Tensor();
  const float* src = xc.data_ptr<float>();
  const float* w = weight.has_value() ? wc.data_ptr<float>() : nullptr;
  float* dst = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * D;
      float* o = dst + r * D;
      const float scale = 1.0f / std::sqrt(dot_lanes(row, row, D) / static_cast<float>(D) + e);
      if (w != nullptr) {
        for (int64_t d = 0; d < D; ++d) o[d] = (row[d] * scale) * w[d];
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = row[d] * scale;
      }
    }
  });
  return out;
}

// runtime/kernels/swiglu.py: silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp
// without a limit) over fp32 rows in one pass, silu as g / (1 + exp(-g)) like torch's CPU
// kernel (16-lane exponential on AVX-512; NaN passes through the clamps as in torch).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, c10::optional<double> limit) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() &&
                  gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat,
              "swiglu: gate and up must be [P, I] fp32");
  TORCH_CHECK((gate.size(1) <= 1 || gate.stride(1) == 1) &&
                  (up.size(1) <= 1 || up.stride(1) == 1),
              "swiglu: rows must be contiguous");
  const int64_t P = gate.size(0), I = gate.size(1);
  at::Tensor out = at::empty({P, I}, gate.options());
  if (out.numel() == 0) return out;
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  float* o = out.data_ptr<float>();
  const bool clamp = limit.has_value();
  const float L = clamp ? static_cast<float>(*limit) : 0.0f;
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * gs;
      const float* ur = u + r * us;
      float* orow = o + r * I;
      int64_t i = 0;
#if defined(NARROW_AVX512)
      const __m512 lim = _mm512_set1_ps(L), neg = _mm512_set1_ps(-L), one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= I; i += 16) {
        __m512 gv = _mm512_loadu_ps(gr + i), uv = _mm512_loadu_ps(ur + i);
        if (clamp) {  // the operand order keeps NaN (min/max return their second on NaN)
          gv = _mm512_min_ps(lim, gv);
          uv = _mm512_max_ps(neg, _mm512_min_ps(lim, uv));
        }
        const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_storeu_ps(orow + i, _mm512_mul_ps(silu, uv));
      }
#endif
      for (; i < I; ++i) {
        float gv = gr[i], uv = ur[i];
        if (clamp) {
          gv = std::isnan(gv) ? gv : std::min(gv, L);
          uv = std::isnan(uv) ? uv : std::max(-L, std::min(uv, L));
        }
        orow[i] = gv / (1.0f + std::exp(-gv)) * uv;
      }
    }
  });
  return out;
}

// runtime/kernels/sinkhorn.py's normalisation of R matrices [n, n] (fp32): a row softmax
// plus eps, a column pass, then iters - 1 row and column passes, each dividing by its sum
// plus eps; the sums in index order as torch's. Blocks of kLanesSk matrices are laid out
// matrix-last in a buffer, so every step is a loop over the block's matrices (vectorised
// by the compiler) instead of a reduction over n elements.
constexpr int64_t kLanesSk = 16;

// R matrices [n, n] from src to dst (which may be src: each block of kLanesSk matrices is
// read into the buffer before it is written back).
void sinkhorn_rows(const float* src, float* dst, int64_t R, int64_t n, int64_t iters,
                   float eps) {
  const int64_t nn = n * n;
  at::parallel_for(0, (R + kLanesSk - 1) / kLanesSk, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(nn * kLanesSk), sum(kLanesSk), top(kLanesSk);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kLanesSk, m = std::min(kLanesSk, R - r0);
      float* c = buf.data();  // c[e * kLanesSk + l]: element e of matrix r0 + l
      std::fill(buf.begin(), buf.end(), 0.0f);
      for (int64_t l = 0; l < m; ++l)
        for (int64_t e = 0; e < nn; ++e) c[e * kLanesSk + l] = src[(r0 + l) * nn + e];
      auto at_ = [&](int64_t i, int64_t j) { return c + (i * n + j) * kLanesSk; };
      float* s = sum.data();
      for (int64_t i = 0; i < n; ++i) {  // row softmax + eps
        float* mx = top.data();
        for (int64_t l = 0; l < kLanesSk; ++l) mx[l] = at_(i, 0)[l];
        for (int64_t j = 1; j < n; ++j)
          for (int64_t l = 0; l < kLanesSk; ++l) mx[l] = std::max(mx[l], at_(i, j)[l]);
        for (int64_t l = 0; l < kLanesSk; ++l) s[l] = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          float* x = at_(i, j);
          for (int64_t l = 0; l < kLanesSk; ++l) {
            x[l] = std::exp(x[l] - mx[l]);
            s[l] += x[l];
          }
        }
        for (int64_t l = 0; l < kLanesSk; ++l) s[l] = 1.0f / s[l];
        for (int64_t j = 0; j < n; ++j) {
          float* x = at_(i, j);
          for (int64_t l = 0; l < kLanesSk; ++l) x[l] = x[l] * s[l] + eps;
        }
      }
      auto normalise = [&](bool rows) {
        for (int64_t a = 0; a < n; ++a) {
          for (int64_t l = 0; l < kLanesSk; ++l) s[l] = 0.0f;
          for (int64_t b = 0; b < n; ++b) {
            const float* x = rows ? at_(a, b) : at_(b, a);
            for (int64_t l = 0; l < kLanesSk; ++l) s[l] += x[l];
          }
          for (int64_t l = 0; l < kLanesSk; ++l) s[l] += eps;
          for (int64_t b = 0; b < n; ++b) {
            float* x = rows ? at_(a, b) : at_(b, a);
            for (int64_t l = 0; l < kLanesSk; ++l) x[l] /= s[l];
          }
        }
      };
      normalise(false);
      for (int64_t it = 1; it < iters; ++it) {
        normalise(true);
        normalise(false);
      }
      for (int64_t l = 0; l < m; ++l)
        for (int64_t e = 0; e < nn; ++e) dst[(r0 + l) * nn + e] = c[e * kLanesSk + l];
    }
  });
}

at::Tensor sinkhorn(const at::Tensor& logits, int64_t iters, double eps_d) {
  TORCH_CHECK(logits.dim() >= 2 && logits.size(-1) == logits.size(-2), "sinkhorn: [..., n, n]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "sinkhorn: float32 logits");
  TORCH_CHECK(iters >= 1, "sinkhorn: iters >= 1");
  const int64_t n = logits.size(-1);
  at::Tensor lc = logits.contiguous();
  at::Tensor out = at::empty_like(lc);
  const int64_t R = n == 0 ? 0 : lc.numel() / (n * n);
  if (R == 0) return out;
  sinkhorn_rows(lc.data_ptr<float>(), out.data_ptr<float>(), R, n, iters,
                static_cast<float>(eps_d));
  return out;
}

// out[t][m] = w[m] . rows[t] for m < M (w [M, K]) and the `count` (<= kMixTokens) rows:
// four rows of w times the rows at once, so that each chunk of w is loaded once for all
// of them (w is read from cache once per tile of tokens, not once per token). `rows` holds
// kMixTokens pointers (those past `count` repeat a valid row; their sums are dropped).
// Each sum's order depends only on K, never on how many rows share the pass.
constexpr int64_t kMixTokens = 4;

inline void dot_rows(const float* w, const float* const* rows, int64_t count, int64_t M,
                     int64_t K, float* out) {
  int64_t m0 = 0;
#if defined(NARROW_AVX512) || defined(NARROW_AVX2)
  constexpr int64_t R = 4;
  for (; m0 + R <= M; m0 += R) {
    const float* wr = w + m0 * K;
    VecF acc[R][kMixTokens];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < kMixTokens; ++t) acc[r][t] = zero();
    int64_t d = 0;
    for (; d + kLanes <= K; d += kLanes) {
      VecF xv[kMixTokens];  // all kMixTokens lanes (constant trip counts keep acc in registers)
      for (int64_t t = 0; t < kMixTokens; ++t) xv[t] = load(rows[t] + d);
      for (int64_t r = 0; r < R; ++r) {
        const VecF wv = load(wr + r * K + d);
        for (int64_t t = 0; t < kMixTokens; ++t) acc[r][t] = fma(wv, xv[t], acc[r][t]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < count; ++t) {
        float s = hsum(acc[r][t]);
        for (int64_t e = d; e < K; ++e) s += wr[r * K + e] * rows[t][e];
        out[t * M + m0 + r] = s;
      }
  }
#endif
  for (; m0 < M; ++m0)
    for (int64_t t = 0; t < count; ++t) out[t * M + m0] = dot_lanes(w + m0 * K, rows[t], K);
}

// row . row, in vector lanes where the build has them (the order depends only on K)
inline float square_sum(const float* row, int64_t K) {
  int64_t d = 0;
  float s = 0.0f;
#if defined(NARROW_AVX512) || defined(NARROW_AVX2)
  VecF acc = zero();
  for (; d + kLanes <= K; d += kLanes) {
    const VecF v = load(row + d);
    acc = fma(v, v, acc);
  }
  s = hsum(acc);
#endif
  for (; d < K; ++d) s += row[d] * row[d];
  return s;
}

// runtime/kernels/hc_pre.py: mHC's collapse of the streams x [T, S, H] (fp32 or bf16) before
// a sub-block, per token: mixes = (fn @ flat(x)) * rsqrt(mean(flat(x)^2) + norm_eps) (the
// scale after the product, as the eager torch form), pre = sigmoid(mixes[:S] * scale[0] +
// base[:S]) + hc_eps, post = 2 sigmoid(mixes[S:2S] * scale[1] + base[S:2S]), comb =
// sinkhorn(mixes[2S:] * scale[2] + base[2S:]) and y = sum_i pre[i] x[i] (fp32 sums in the
// order i = 0, 1, ..., one rounding to x's dtype). fn [S(2+S), S H], scale [3], base
// [S(2+S)] fp32 -> y [T, H] (x's dtype), post [T, S], comb [T, S, S] (fp32). Tokens go in
// tiles of kMixTokens, whose streams stay in cache from the mixes to the collapse; a
// token's results do not depend on the tokens beside it.
template <typename scalar_t>
void collapse_streams(const scalar_t* x, const float* fn, const float* scale, const float* base,
                      float norm_eps, float hc_eps, scalar_t* y, float* post, float* logits,
                      int64_t T, int64_t S, int64_t H) {
  const int64_t K = S * H, M = S * (2 + S);
  constexpr bool kWide = std::is_same<scalar_t, float>::value;
  const int64_t tiles = (T + kMixTokens - 1) / kMixTokens;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(kWide ? 0 : kMixTokens * K);
    std::vector<float> mix(kMixTokens * M), pre(S), acc(H);
    const float* rows[kMixTokens];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = tile * kMixTokens, count = std::min(kMixTokens, T - t0);
      for (int64_t u = 0; u < count; ++u) {
        const scalar_t* xt = x + (t0 + u) * K;
        if constexpr (kWide) {
          rows[u] = xt;
        } else {
          float* wide = widened.data() + u * K;
          for (int64_t k = 0; k < K; ++k) wide[k] = static_cast<float>(xt[k]);
          rows[u] = wide;
        }
      }
      for (int64_t u = count; u < kMixTokens; ++u) rows[u] = rows[0];
      dot_rows(fn, rows, count, M, K, mix.data());
      for (int64_t u = 0; u < count; ++u) {
        const int64_t t = t0 + u;
        const float* row = rows[u];
        float* m = mix.data() + u * M;
        const float r = 1.0f / std::sqrt(square_sum(row, K) / static_cast<float>(K) + norm_eps);
        for (int64_t e = 0; e < M; ++e) m[e] *= r;
        for (int64_t i = 0; i < S; ++i) {
          pre[i] = 1.0f / (1.0f + std::exp(-(m[i] * scale[0] + base[i]))) + hc_eps;
          post[t * S + i] = 2.0f / (1.0f + std::exp(-(m[S + i] * scale[1] + base[S + i])));
        }
        for (int64_t e = 0; e < S * S; ++e)
          logits[t * S * S + e] = m[2 * S + e] * scale[2] + base[2 * S + e];
        float* a = acc.data();
        for (int64_t h = 0; h < H; ++h) a[h] = pre[0] * row[h];
        for (int64_t i = 1; i < S; ++i) {
          const float p = pre[i];
          const float* ri = row + i * H;
          for (int64_t h = 0; h < H; ++h) a[h] += p * ri[h];
        }
        scalar_t* yt = y + t * H;
        for (int64_t h = 0; h < H; ++h) yt[h] = static_cast<scalar_t>(a[h]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& x, const at::Tensor& fn,
                                                      const at::Tensor& scale,
                                                      const at::Tensor& base, double norm_eps,
                                                      double hc_eps, int64_t iters) {
  TORCH_CHECK(x.dim() == 3, "hc_pre: x [T, S, H]");
  const int64_t T = x.size(0), S = x.size(1), H = x.size(2), M = S * (2 + S);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "hc_pre: float32 or bfloat16 streams");
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == M && fn.size(1) == S * H &&
                  fn.scalar_type() == at::kFloat,
              "hc_pre: fn must be [S (2 + S), S H] fp32");
  TORCH_CHECK(scale.numel() == 3 && scale.scalar_type() == at::kFloat,
              "hc_pre: scale must be [3] fp32");
  TORCH_CHECK(base.numel() == M && base.scalar_type() == at::kFloat,
              "hc_pre: base must be [S (2 + S)] fp32");
  TORCH_CHECK(iters >= 1, "hc_pre: iters >= 1");
  at::Tensor y = at::empty({T, H}, x.options());
  at::Tensor post = at::empty({T, S}, x.options().dtype(at::kFloat));
  at::Tensor comb = at::empty({T, S, S}, x.options().dtype(at::kFloat));
  if (T == 0 || S == 0) return {y, post, comb};
  at::Tensor xc = x.contiguous(), fc = fn.contiguous();
  at::Tensor sc = scale.contiguous(), bc = base.contiguous();
  const float ne = static_cast<float>(norm_eps), he = static_cast<float>(hc_eps);
  if (x.scalar_type() == at::kFloat) {
    collapse_streams<float>(xc.data_ptr<float>(), fc.data_ptr<float>(), sc.data_ptr<float>(),
                            bc.data_ptr<float>(), ne, he, y.data_ptr<float>(),
                            post.data_ptr<float>(), comb.data_ptr<float>(), T, S, H);
  } else {
    collapse_streams<at::BFloat16>(xc.data_ptr<at::BFloat16>(), fc.data_ptr<float>(),
                                   sc.data_ptr<float>(), bc.data_ptr<float>(), ne, he,
                                   y.data_ptr<at::BFloat16>(), post.data_ptr<float>(),
                                   comb.data_ptr<float>(), T, S, H);
  }
  sinkhorn_rows(comb.data_ptr<float>(), comb.data_ptr<float>(), T, S, iters, he);
  return {y, post, comb};
}

// ---- AMX tile products ---------------------------------------------------------------
// out [M, N] = x [M, K] fp32 @ weight [N, K]^T, weight bf16. Each row of x is split by
// truncation into three bf16 parts, x = hi + mid + lo exactly (8 significant bits each),
// and every part is multiplied by the weight on the tiles (TDPBF16PS: products of two bf16
// values are exact in fp32, sums in fp32), so only the order of the sums differs from an
// fp32 product (3xTF32 on GPUs splits the same way). The weight is packed once
// (tile_product.py's `pack`: [Kp / 2, Np, 2], pairs of K interleaved, as the tile product
// reads its second operand, K and N padded with zeros to multiples of 32); rows go in
// blocks of 32 (two tiles), split into a per-thread buffer just before their products,
// columns in blocks of 32.
#if defined(NARROW_AVX512) && defined(__linux__) && defined(__GNUC__) && \
    (defined(__clang__) || __GNUC__ >= 11)
#define NEXTN_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

constexpr int64_t kTileRows = 16, kTileK = 32, kTileBlock = 32;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// the CPU has AMX-BF16 and the kernel let this process use the tile registers
bool tile_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

// rows r0 .. r0 + 32 of x into parts [32, 3, Kp] (hi, mid, lo), rows past M zero
AMX_TARGET void split_block(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t r0,
                            uint16_t* parts) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < kTileBlock; ++i) {
    uint16_t* hi = parts + i * 3 * Kp;
    if (r0 + i >= M) {
      std::memset(hi, 0, 3 * Kp * sizeof(uint16_t));
      continue;
    }
    const float* src = x + (r0 + i) * K;
    for (int64_t k = 0; k < Kp; k += 16) {
      const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, K - k));
      const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), src + k);
      const __m512i b0 = _mm512_castps_si512(v);
      const __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_and_si512(b0, top)));
      const __m512i b1 = _mm512_castps_si512(r1);
      const __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(_mm512_and_si512(b1, top)));
      const __m512i b2 = _mm512_castps_si512(r2);
      auto store = [&](uint16_t* dst, __m512i bits) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
      };
      store(hi, b0);
      store(hi + Kp, b1);
      store(hi + 2 * Kp, b2);
    }
  }
}

// out rows r0 .. r0 + 32, columns n0 .. n0 + 32 (clipped to M, N)
AMX_TARGET void tile_block(const uint16_t* parts, int64_t Kp, const uint16_t* packed,
                           int64_t Np, float* out, int64_t M, int64_t N, int64_t r0,
                           int64_t n0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = 3 * Kp * sizeof(uint16_t), b_stride = Np * 2 * sizeof(uint16_t);
  const uint16_t* a0 = parts;
  const uint16_t* a1 = parts + kTileRows * 3 * Kp;
  for (int64_t k = 0; k < Kp; k += kTileK) {
    const uint16_t* b = packed + (k / 2) * Np * 2 + n0 * 2;
    _tile_loadd(6, b, b_stride);
    _tile_loadd(7, b + 2 * kTileRows, b_stride);
    for (int64_t part = 0; part < 3; ++part) {
      _tile_loadd(4, a0 + part * Kp + k, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + part * Kp + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (r0 + kTileBlock <= M && n0 + kTileBlock <= N) {
    const int64_t stride = N * sizeof(float);
    _tile_stored(0, out + r0 * N + n0, stride);
    _tile_stored(1, out + r0 * N + n0 + kTileRows, stride);
    _tile_stored(2, out + (r0 + kTileRows) * N + n0, stride);
    _tile_stored(3, out + (r0 + kTileRows) * N + n0 + kTileRows, stride);
    return;
  }
  alignas(64) float buf[kTileBlock * kTileBlock];
  const int64_t stride = kTileBlock * sizeof(float);
  _tile_stored(0, buf, stride);
  _tile_stored(1, buf + kTileRows, stride);
  _tile_stored(2, buf + kTileRows * kTileBlock, stride);
  _tile_stored(3, buf + kTileRows * kTileBlock + kTileRows, stride);
  const int64_t cols = std::min(kTileBlock, N - n0);
  for (int64_t i = 0; i < kTileBlock && r0 + i < M; ++i)
    std::memcpy(out + (r0 + i) * N + n0, buf + i * kTileBlock, cols * sizeof(float));
}

// the tile configuration every product here uses: eight 16 x 64-byte tiles
AMX_TARGET void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  // GCC's `_tile_loadconfig` names only the first 8 bytes as its memory operand, so without
  // this barrier the compiler may drop the stores of the rest of the configuration
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

AMX_TARGET void release_tiles() { _tile_release(); }

// one block of 32 rows (from row r0 of the M rows at x) times one packed weight
AMX_TARGET void tile_rows(const float* x, int64_t M, int64_t K, const uint16_t* packed,
                          int64_t Kp, int64_t Np, float* out, int64_t N, int64_t r0,
                          uint16_t* parts) {
  split_block(x, M, K, Kp, r0, parts);
  for (int64_t n0 = 0; n0 < N; n0 += kTileBlock)
    tile_block(parts, Kp, packed, Np, out, M, N, r0, n0);
}
#else
bool tile_ready() { return false; }
#endif

// x [M, K] fp32 times packed weights (tile_product.py's `pack` of [n, K] bf16 weights):
// packed [Kp / 2, Np, 2] for every row, or [E, Kp / 2, Np, 2] with group_ends [E] (running
// row counts: rows group_ends[e - 1] .. group_ends[e] times weight e) -> [M, n] fp32
at::Tensor tile_product(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& group_ends) {
  TORCH_CHECK(tile_ready(), "tile_product: AMX tiles are not available");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "tile_product: x must be [M, K] float32");
  const bool grouped = group_ends.has_value();
  TORCH_CHECK(packed.dim() == (grouped ? 4 : 3) && packed.size(-1) == 2 &&
                  packed.scalar_type() == at::kBFloat16,
              "tile_product: packed must be packed bf16 weights ([E,] Kp / 2, Np, 2)");
  const int64_t M = x.size(0), K = x.size(1), Kp = packed.size(-3) * 2, Np = packed.size(-2);
  TORCH_CHECK(Kp == (K + 31) / 32 * 32 && n <= Np && Np == (n + 31) / 32 * 32,
              "tile_product: x, packed and n disagree");
  const int64_t E = grouped ? packed.size(0) : 1;
  std::vector<int64_t> ends(E, M);
  if (grouped) {
    at::Tensor gc = group_ends->to(at::kLong).contiguous();
    TORCH_CHECK(gc.dim() == 1 && gc.size(0) == E, "tile_product: group_ends must be [E]");
    const int64_t* gp = gc.data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e) {
      TORCH_CHECK(gp[e] >= (e ? gp[e - 1] : 0) && gp[e] <= M,
                  "tile_product: group_ends must rise from 0 to at most M");
      ends[e] = gp[e];
    }
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
#if defined(NEXTN_AMX)
  at::Tensor xc = x.contiguous(), pc = packed.contiguous();
  const float* xp = xc.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(pc.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const int64_t weight_size = (Kp / 2) * Np * 2;
  // work items: each group's blocks of 32 rows
  std::vector<std::pair<int64_t, int64_t>> items;  // (group, first row)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = e ? ends[e - 1] : 0; r < ends[e]; r += kTileBlock) items.emplace_back(e, r);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    std::vector<uint16_t> parts(kTileBlock * 3 * Kp);
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, r] = items[i];
      const int64_t first = e ? ends[e - 1] : 0;
      tile_rows(xp + first * K, ends[e] - first, K, pp + e * weight_size, Kp, Np,
                op + first * n, n, r - first, parts.data());
    }
    release_tiles();
  });
  if (grouped && ends[E - 1] < M) out.narrow(0, ends[E - 1], M - ends[E - 1]).zero_();
#endif
  return out;
}

// x [..., K] fp32 times weight [N, K]^T (+ bias [N]) -> [..., N]. ATen's oneDNN linear
// (what inductor calls for a frozen weight) takes a plain weight too; it is registered in
// libtorch under the `mkldnn` namespace, so it is called boxed through the dispatcher.
//
// oneDNN builds a primitive per shape (about 0.36 ms for a [M, 256] x [256, 256] product
// met the first time, one thread, against 0.23 ms for the product once built) and caches
// 1,024 of them, so a product is created for the rows rounded up to a short ladder
// (`ladder_rows`): ragged prefill chunks and routed-expert groups, whose row counts differ
// from step to step, then reuse about twenty shapes per weight instead of building one
// for almost every call. The padding rows are zeros and their results are dropped.
int64_t ladder_rows(int64_t rows) {
  const int64_t step = rows <= 128 ? 16 : rows <= 512 ? 64 : rows <= 2048 ? 256 : 512;
  return (rows + step - 1) / step * step;
}

at::Tensor dense_product(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "dense_product: fp32 rows and weight");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "dense_product: shapes");
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t K = weight.size(1), N = weight.size(0);
  at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0), padded = ladder_rows(M);
  if (padded != M) {
    at::Tensor grown = at::empty({padded, K}, rows.options());
    grown.narrow(0, 0, M).copy_(rows);
    grown.narrow(0, M, padded - M).zero_();
    rows = grown;
  }
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(rows);
  stack.emplace_back(weight.contiguous());
  stack.emplace_back(bias.has_value() ? c10::IValue(bias->contiguous()) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  if (padded != M) out = out.narrow(0, 0, M);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

// One tile row's scores -> their softmax over the row's valid keys, in place; returns the
// log-sum-exp (-inf, and a row of zeros, where no key is valid).
inline float tile_softmax_row(float* z, const bool* valid, int64_t K, float scale) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float top = kNegInf;
#if defined(NARROW_AVX512)
  __m512 tops = _mm512_set1_ps(kNegInf);
  const __m512 sv = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNegInf);
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t n = std::min<int64_t>(16, K - k);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
    __m128i bytes;
    if (n == 16) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(valid + k));
    } else {
      alignas(16) uint8_t buf[16] = {0};
      std::memcpy(buf, valid + k, n);
      bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    }
    const __m512i wide = _mm512_cvtepu8_epi32(bytes);
    const __mmask16 seen = _mm512_test_epi32_mask(wide, wide) & m;
    const __m512 v = _mm512_mask_mul_ps(none, seen, _mm512_maskz_loadu_ps(m, z + k), sv);
    _mm512_mask_storeu_ps(z + k, m, v);
    tops = _mm512_mask_max_ps(tops, m, tops, v);
  }
  top = _mm512_reduce_max_ps(tops);
#else
  for (int64_t k = 0; k < K; ++k) {
    z[k] = valid[k] ? z[k] * scale : kNegInf;
    top = std::max(top, z[k]);
  }
#endif
  if (top == kNegInf) {
    std::fill(z, z + K, 0.0f);
    return top;
  }
  const float sum = exp_shifted_sum(z, K, top, 0.0f);
  const float inv = 1.0f / sum;
  for (int64_t k = 0; k < K; ++k) z[k] *= inv;
  return top + std::log(sum);
}

// runtime/kernels/sink_attention.py's tile attention of eager prefill (DeepSeek-V4's single
// latent, key and value alike, shared by a tile's rows and by every head): per tile its
// R x H queries (gathered from the rows, row r's heads consecutive) times its keys in one
// GEMM, the masked softmax and log-sum-exp in place while the scores sit in the core's
// cache, the output in a second GEMM. The GEMMs are oneDNN's where it was chosen
// (`onednn`), else ATen's default. PyTorch's flash kernel, which this replaces on CPU,
// multiplies head by head ([R, D] by [D, K]).
// q [T, H, D], tile_rows [N, R] (row T: a padding lane, zeros), kv [N, K, D] fp32,
// valid [N, R, K] bool -> (out [N, R, H, D] normalised over the tile's valid keys,
// lse [N, R, H]; a lane that sees no key: zeros and -inf)
std::tuple<at::Tensor, at::Tensor> tile_attention(const at::Tensor& q, const at::Tensor& tile_rows,
                                                  const at::Tensor& kv, const at::Tensor& valid,
                                                  double scale, bool onednn) {
  TORCH_CHECK(q.dim() == 3 && tile_rows.dim() == 2 && kv.dim() == 3 && valid.dim() == 3,
              "tile_attention: q [T, H, D], tile_rows [N, R], kv [N, K, D], valid [N, R, K]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat,
              "tile_attention: fp32 q and kv");
  TORCH_CHECK(tile_rows.scalar_type() == at::kLong && valid.scalar_type() == at::kBool,
              "tile_attention: int64 tile_rows, bool valid");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t N = tile_rows.size(0), R = tile_rows.size(1), K = kv.size(1);
  TORCH_CHECK(kv.size(0) == N && kv.size(2) == D, "tile_attention: kv [N, K, D]");
  TORCH_CHECK(valid.size(0) == N && valid.size(1) == R && valid.size(2) == K,
              "tile_attention: valid [N, R, K]");
  at::Tensor rc = tile_rows.contiguous();
  if (rc.numel() > 0) {
    TORCH_CHECK(rc.min().item<int64_t>() >= 0 && rc.max().item<int64_t>() <= T,
                "tile_attention: tile_rows outside the rows");
  }
  at::Tensor out = at::empty({N, R, H, D}, q.options());
  at::Tensor lse = at::empty({N, R, H}, q.options());
  if (out.numel() == 0) return {out, lse};
  if (K == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  at::Tensor qc = q.contiguous(), kc = kv.contiguous(), vc = valid.contiguous();
  const float sc = static_cast<float>(scale);
  const int64_t row_size = H * D, M = R * H;
  auto product = [onednn](const at::Tensor& x, const at::Tensor& w) {
    return onednn ? dense_product(x, w, std::nullopt) : at::mm(x, w.t());
  };
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    at::Tensor queries = at::empty({M, D}, q.options());
    for (int64_t n = begin; n < end; ++n) {
      const int64_t* lanes = rc.data_ptr<int64_t>() + n * R;
      float* dst = queries.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r, dst += row_size) {
        if (lanes[r] < T)
          std::memcpy(dst, qc.data_ptr<float>() + lanes[r] * row_size, row_size * sizeof(float));
        else
          std::fill(dst, dst + row_size, 0.0f);
      }
      const at::Tensor keys = kc.select(0, n);
      at::Tensor scores = product(queries, keys).contiguous();  // [M, K]
      float* z = scores.data_ptr<float>();
      const bool* seen = vc.data_ptr<bool>() + n * R * K;
      float* l = lse.data_ptr<float>() + n * M;
      for (int64_t m = 0; m < M; ++m) l[m] = tile_softmax_row(z + m * K, seen + (m / H) * K, K, sc);
      out.select(0, n).view({M, D}).copy_(product(scores, keys.t().contiguous()));
    }
  });
  return {out, lse};
}

// x [A, K] fp32, rows sorted by group, times weight [G, N, K]: rows
// group_ends[g-1]:group_ends[g] times weight[g] (dense_product per group), rows past the
// last group zero -> [A, N]. The groups' bounds are read on the host (CPU tensors).
at::Tensor dense_grouped_product(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& group_ends) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
              "dense_grouped_product: shapes");
  TORCH_CHECK(group_ends.numel() == weight.size(0), "dense_grouped_product: one end per group");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, weight.size(1)}, x.options());
  const at::Tensor ends = group_ends.to(at::kLong).contiguous();
  const int64_t* end_of = ends.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t g = 0; g < weight.size(0); ++g) {
    const int64_t end = std::min(std::max(end_of[g], start), rows);
    if (end > start) {
      out.narrow(0, start, end - start)
          .copy_(dense_product(x.narrow(0, start, end - start), weight.select(0, g), std::nullopt));
    }
    start = end;
  }
  if (start < rows) out.narrow(0, start, rows - start).zero_();
  return out;
}

// runtime/kernels/sink_attention.py's grouped attention of a uniform (decode, verify or
// draft) step: every request runs R rows, whose R x H queries share the request's keys
// (DeepSeek-V4's single latent, key and value alike), each row perhaps with its own
// selected keys too, and every head has an attention sink. Per request, in the core's cache:
// the queries transposed to [D, M] (M = R x H, padded to whole vectors), the scores
// computed transposed ([keys, M]: a key's value broadcast against vectors of queries), so
// that the masked softmax runs down the keys with the queries in the vector lanes (no
// horizontal reductions), and the output as the exponentials times the keys, scaled by each
// query's 1 / sum once at the end. Every query's sums run in the same order whatever the
// batch, the rows per request or the lanes it sits in, so decode, verify and draft steps of
// any bucket give a query bit-identical results. PyTorch's batched products, which this
// replaces in captured steps, ran these small shapes ([32, 64] x [64, 131] per request) at
// about 85 GFLOP/s through MKL on an AMD EPYC.
// q [B, R, H, D], kv [B, K, D], valid [B, R, K] bool, row_kv [B * R, Kr, D] and row_valid
// [B * R, Kr] bool (or none), sink [H] -> out [B * R, H, D], all fp32.
constexpr int64_t kGroupLanes = 16;

#if defined(NARROW_AVX512)
// scores^T rows k0 .. k0 + MR (keys `keys[i]`) x query vectors v0 .. v0 + NV
template <int MR, int NV>
inline void transposed_scores(const float* const* keys, const float* qt, int64_t Mp, int64_t D,
                              float* const* out) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(qt + d * Mp + v * kGroupLanes);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(keys[i][d]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    if (out[i] != nullptr)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[i] + v * kGroupLanes, acc[i][v]);
}

// out rows m0 .. m0 + 4 (columns d0 .. d0 + 16 NV, the last vector masked by `tail`) +=
// sum_k e[k, m] x values[m][k, d]: `e` [n, Mp] from column m0, `values[i]` lane i's keys
template <int NV>
inline void weighted_keys(const float* e, int64_t Mp, const float* const* values, int64_t D,
                          int64_t n, __mmask16 tail, __m512 (&acc)[4][NV]) {
  const bool shared = values[0] == values[1] && values[0] == values[2] && values[0] == values[3];
  for (int64_t k = 0; k < n; ++k) {
    const float* w = e + k * Mp;
    if (shared) {
      __m512 b[NV];
      for (int v = 0; v < NV; ++v)
        b[v] = v + 1 < NV ? _mm512_loadu_ps(values[0] + k * D + v * kGroupLanes)
                          : _mm512_maskz_loadu_ps(tail, values[0] + k * D + v * kGroupLanes);
      for (int i = 0; i < 4; ++i) {
        const __m512 a = _mm512_set1_ps(w[i]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m512 a = _mm512_set1_ps(w[i]);
        for (int v = 0; v < NV; ++v) {
          const float* src = values[i] + k * D + v * kGroupLanes;
          const __m512 b = v + 1 < NV ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(tail, src);
          acc[i][v] = _mm512_fmadd_ps(a, b, acc[i][v]);
        }
      }
    }
  }
}
#endif

// scores^T [n, Mp] (rows `keys[k]`) for the query vectors v_begin .. v_end (16 lanes
// each): s[k, m] = sum_d keys[k][d] qt[d, m], rows of `s` and `qt` Mp apart
void group_scores(const float* const* keys, int64_t n, const float* qt, int64_t Mp, int64_t D,
                  int64_t v_begin, int64_t v_end, float* s) {
#if defined(NARROW_AVX512)
  // keys per block: as many as the accumulators allow (24 vectors), fewer where that
  // spreads n keys over the same number of blocks with fewer recomputed past the end
  constexpr int kMaxKeys = 24;
  for (int64_t v0 = v_begin; v0 < v_end;) {
    const int64_t nv = std::min<int64_t>(2, v_end - v0);
    const int64_t widest = kMaxKeys / nv;
    const int64_t blocks = std::max<int64_t>(1, (n + widest - 1) / widest);
    const int64_t step = widest / 3;  // block sizes offered: thirds of the widest
    const int64_t mr = std::min(widest, ((n + blocks - 1) / blocks + step - 1) / step * step);
    for (int64_t k0 = 0; k0 < n; k0 += mr) {
      const float* rows[kMaxKeys];
      float* out[kMaxKeys];
      for (int64_t i = 0; i < mr; ++i) {
        const int64_t k = std::min(k0 + i, n - 1);  // past the end: recomputed, not stored
        rows[i] = keys[k];
        out[i] = k0 + i < n ? s + (k0 + i) * Mp + v0 * kGroupLanes : nullptr;
      }
      const float* qv = qt + v0 * kGroupLanes;
      switch (nv * 100 + mr) {
        case 204: transposed_scores<4, 2>(rows, qv, Mp, D, out); break;
        case 208: transposed_scores<8, 2>(rows, qv, Mp, D, out); break;
        case 212: transposed_scores<12, 2>(rows, qv, Mp, D, out); break;
        case 108: transposed_scores<8, 1>(rows, qv, Mp, D, out); break;
        case 116: transposed_scores<16, 1>(rows, qv, Mp, D, out); break;
        default: transposed_scores<24, 1>(rows, qv, Mp, D, out); break;
      }
    }
    v0 += nv;
  }
#else
  const int64_t m_begin = v_begin * kGroupLanes, m_end = v_end * kGroupLanes;
  for (int64_t k = 0; k < n; ++k) {
    float* row = s + k * Mp;
    std::fill(row + m_begin, row + m_end, 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float a = keys[k][d];
      const float* b = qt + d * Mp;
      for (int64_t m = m_begin; m < m_end; ++m) row[m] += a * b[m];
    }
  }
#endif
}

// scores^T rows [n, Mp] -> scaled, -inf where lane m's row does not see key k
// (`seen[row * stride + k]`), the running top of each lane raised to them
void mask_scores(float* s, int64_t n, int64_t Mp, const bool* seen, int64_t stride,
                 const int64_t* lane_row, const uint16_t* lane_bits, int64_t R, float scale,
                 float* top) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if defined(NARROW_AVX512)
  const __m512 sv = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNegInf);
  for (int64_t v = 0; v < Mp / kGroupLanes; ++v) {
    const int64_t r_lo = lane_row[v * kGroupLanes];
    const int64_t r_hi = std::min(lane_row[v * kGroupLanes + kGroupLanes - 1], R - 1);
    __m512 tops = _mm512_loadu_ps(top + v * kGroupLanes);
    for (int64_t k = 0; k < n; ++k) {
      uint32_t bits = 0;
      for (int64_t r = r_lo; r <= r_hi; ++r)
        if (seen[r * stride + k]) bits |= lane_bits[v * R + r];
      float* z = s + k * Mp + v * kGroupLanes;
      const __m512 x = _mm512_mask_mul_ps(none, static_cast<__mmask16>(bits), _mm512_loadu_ps(z), sv);
      _mm512_storeu_ps(z, x);
      tops = _mm512_max_ps(tops, x);
    }
    _mm512_storeu_ps(top + v * kGroupLanes, tops);
  }
#else
  for (int64_t k = 0; k < n; ++k) {
    float* row = s + k * Mp;
    for (int64_t m = 0; m < Mp; ++m) {
      const int64_t r = lane_row[m];
      row[m] = r < R && seen[r * stride + k] ? row[m] * scale : kNegInf;
      top[m] = std::max(top[m], row[m]);
    }
  }
#endif
}

// rows [n, Mp] <- exp(rows - top) lane by lane, their sums added to `sums`
void exponentials(float* s, int64_t n, int64_t Mp, const float* top, float* sums) {
  for (int64_t k = 0; k < n; ++k) {
    float* row = s + k * Mp;
#if defined(NARROW_AVX512)
    for (int64_t m = 0; m < Mp; m += kGroupLanes) {
      const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(row + m), _mm512_loadu_ps(top + m)));
      _mm512_storeu_ps(row + m, e);
      _mm512_storeu_ps(sums + m, _mm512_add_ps(_mm512_loadu_ps(sums + m), e));
    }
#else
    for (int64_t m = 0; m < Mp; ++m) {
      row[m] = std::exp(row[m] - top[m]);
      sums[m] += row[m];
    }
#endif
  }
}

at::Tensor group_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& valid,
                           const c10::optional<at::Tensor>& row_kv,
                           const c10::optional<at::Tensor>& row_valid, const at::Tensor& sink,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && kv.dim() == 3 && valid.dim() == 3,
              "group_attention: q [B, R, H, D], kv [B, K, D], valid [B, R, K]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  sink.scalar_type() == at::kFloat && valid.scalar_type() == at::kBool,
              "group_attention: fp32 q, kv and sink, bool valid");
  const int64_t B = q.size(0), R = q.size(1), H = q.size(2), D = q.size(3), K = kv.size(1);
  TORCH_CHECK(kv.size(0) == B && kv.size(2) == D, "group_attention: kv [B, K, D]");
  TORCH_CHECK(valid.size(0) == B && valid.size(1) == R && valid.size(2) == K,
              "group_attention: valid [B, R, K]");
  TORCH_CHECK(sink.numel() == H, "group_attention: sink [H]");
  TORCH_CHECK(row_kv.has_value() == row_valid.has_value(),
              "group_attention: row_kv and row_valid together");
  int64_t Kr = 0;
  at::Tensor rk, rv;
  if (row_kv.has_value()) {
    rk = row_kv->contiguous();
    rv = row_valid->contiguous();
    Kr = rk.size(1);
    TORCH_CHECK(rk.dim() == 3 && rk.size(0) == B * R && rk.size(2) == D &&
                    rk.scalar_type() == at::kFloat,
                "group_attention: row_kv [B * R, Kr, D] fp32");
    TORCH_CHECK(rv.dim() == 2 && rv.size(0) == B * R && rv.size(1) == Kr &&
                    rv.scalar_type() == at::kBool,
                "group_attention: row_valid [B * R, Kr] bool");
  }
  at::Tensor out = at::empty({B * R, H, D}, q.options());
  if (out.numel() == 0) return out;
  const at::Tensor qc = q.contiguous(), kc = kv.contiguous(), vc = valid.contiguous();
  const at::Tensor sc = sink.contiguous();
  const int64_t M = R * H, Mp = (M + kGroupLanes - 1) / kGroupLanes * kGroupLanes;
  const float fscale = static_cast<float>(scale);
  const float* qd = qc.data_ptr<float>();
  const float* kd = kc.data_ptr<float>();
  const bool* vd = vc.data_ptr<bool>();
  const float* rkd = Kr ? rk.data_ptr<float>() : nullptr;
  const bool* rvd = Kr ? rv.data_ptr<bool>() : nullptr;
  float* od = out.data_ptr<float>();
  // a lane's row (R for padding lanes, which see nothing), sink logit, and the bits of
  // each row's lanes in each vector
  const int64_t V = Mp / kGroupLanes;
  std::vector<int64_t> lane_row(Mp);
  std::vector<float> lane_sink(Mp, 0.0f);
  std::vector<uint16_t> lane_bits(V * R, 0);
  for (int64_t m = 0; m < Mp; ++m) {
    lane_row[m] = m < M ? m / H : R;
    if (m < M) {
      lane_sink[m] = sc.data_ptr<float>()[m % H];
      lane_bits[(m / kGroupLanes) * R + m / H] |= static_cast<uint16_t>(1u << (m % kGroupLanes));
    }
  }
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt(D * Mp, 0.0f), s(std::max<int64_t>(K, 1) * Mp), t(Kr * Mp);
    std::vector<float> part(Kr * Mp), top(Mp), inv(Mp);
    std::vector<const float*> keys(std::max(K, Kr));
    for (int64_t b = begin; b < end; ++b) {
      const float* qb = qd + b * M * D;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = qb[m * D + d];
      const float* kb = kd + b * K * D;
      for (int64_t k = 0; k < K; ++k) keys[k] = kb + k * D;
      group_scores(keys.data(), K, qt.data(), Mp, D, 0, V, s.data());
      // each row's own keys against the vectors holding its lanes; its lanes kept in t
      for (int64_t r = 0; r < R && Kr; ++r) {
        const float* own = rkd + (b * R + r) * Kr * D;
        for (int64_t j = 0; j < Kr; ++j) keys[j] = own + j * D;
        const int64_t v_begin = r * H / kGroupLanes, v_end = ((r + 1) * H - 1) / kGroupLanes + 1;
        group_scores(keys.data(), Kr, qt.data(), Mp, D, v_begin, v_end, part.data());
        for (int64_t j = 0; j < Kr; ++j)
          std::memcpy(t.data() + j * Mp + r * H, part.data() + j * Mp + r * H, H * sizeof(float));
      }
      // masked, scaled scores; each lane's top (its sink included); the exponentials and
      // their sums (the sink's term has no value)
      std::copy(lane_sink.begin(), lane_sink.end(), top.begin());
      mask_scores(s.data(), K, Mp, vd + b * R * K, K, lane_row.data(), lane_bits.data(), R,
                  fscale, top.data());
      if (Kr)
        mask_scores(t.data(), Kr, Mp, rvd + b * R * Kr, Kr, lane_row.data(), lane_bits.data(),
                    R, fscale, top.data());
      std::fill(inv.begin(), inv.end(), 0.0f);
      exponentials(s.data(), K, Mp, top.data(), inv.data());
      exponentials(t.data(), Kr, Mp, top.data(), inv.data());
      for (int64_t m = 0; m < Mp; ++m) inv[m] = 1.0f / (inv[m] + std::exp(lane_sink[m] - top[m]));
      // out = (e x keys) / sum, four lanes at a time
      float* ob = od + b * M * D;
#if defined(NARROW_AVX512)
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        for (int64_t d0 = 0; d0 < D; d0 += 4 * kGroupLanes) {
          const int64_t nd = std::min<int64_t>(4 * kGroupLanes, D - d0);
          const int64_t nv = (nd + kGroupLanes - 1) / kGroupLanes;
          const int64_t last = nd - (nv - 1) * kGroupLanes;
          const __mmask16 tail = static_cast<__mmask16>(last == 16 ? 0xFFFFu : (1u << last) - 1u);
          const float* shared[4] = {kb + d0, kb + d0, kb + d0, kb + d0};
          const float* own[4];
          for (int i = 0; i < 4; ++i) {
            const int64_t r = std::min(lane_row[m0 + i], R - 1);
            own[i] = Kr ? rkd + (b * R + r) * Kr * D + d0 : nullptr;
          }
          auto run = [&](auto nv_tag) {
            constexpr int NV = decltype(nv_tag)::value;
            __m512 acc[4][NV];
            for (int i = 0; i < 4; ++i)
              for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
            weighted_keys<NV>(s.data() + m0, Mp, shared, D, K, tail, acc);
            if (Kr) weighted_keys<NV>(t.data() + m0, Mp, own, D, Kr, tail, acc);
            for (int i = 0; i < 4 && m0 + i < M; ++i) {
              const __m512 scale_i = _mm512_set1_ps(inv[m0 + i]);
              for (int v = 0; v < NV; ++v) {
                float* dst = ob + (m0 + i) * D + d0 + v * kGroupLanes;
                const __m512 y = _mm512_mul_ps(acc[i][v], scale_i);
                if (v + 1 < NV)
                  _mm512_storeu_ps(dst, y);
                else
                  _mm512_mask_storeu_ps(dst, tail, y);
              }
            }
          };
          switch (nv) {
            case 1: run(std::integral_constant<int, 1>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            default: run(std::integral_constant<int, 4>{}); break;
          }
        }
      }
#else
      for (int64_t m = 0; m < M; ++m) {
        float* dst = ob + m * D;
        std::fill(dst, dst + D, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const float w = s[k * Mp + m];
          for (int64_t d = 0; d < D; ++d) dst[d] += w * kb[k * D + d];
        }
        const float* own = Kr ? rkd + (b * R + lane_row[m]) * Kr * D : nullptr;
        for (int64_t j = 0; j < Kr; ++j) {
          const float w = t[j * Mp + m];
          for (int64_t d = 0; d < D; ++d) dst[d] += w * own[j * D + d];
        }
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv[m];
      }
#endif
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nextn_cpu, m) {
  m.def("narrow_product(Tensor x, Tensor weight, Tensor? index=None) -> Tensor");
  m.def("indexer_topk(Tensor scores, Tensor lengths, Tensor visible, int k) -> (Tensor, Tensor)");
  m.def("hc_post(Tensor block, Tensor residual, Tensor post, Tensor comb) -> Tensor");
  m.def("sinkhorn(Tensor logits, int iters, float eps) -> Tensor");
  m.def(
      "hc_pre(Tensor x, Tensor fn, Tensor scale, Tensor base, float norm_eps, float hc_eps, "
      "int iters) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("swiglu(Tensor gate, Tensor up, float? limit) -> Tensor");
  m.def("tile_ready() -> bool");
  m.def("dense_product(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("dense_grouped_product(Tensor x, Tensor weight, Tensor group_ends) -> Tensor");
  m.def("tile_product(Tensor x, Tensor packed, int n, Tensor? group_ends=None) -> Tensor");
  m.def(
      "merge_row_keys(Tensor tile_out, Tensor tile_lse, Tensor q, Tensor source, Tensor index, "
      "Tensor valid, Tensor sink, float scale) -> Tensor");
  m.def(
      "tile_attention(Tensor q, Tensor tile_rows, Tensor kv, Tensor valid, float scale, "
      "bool onednn) -> "
      "(Tensor, Tensor)");
  m.def(
      "group_attention(Tensor q, Tensor kv, Tensor valid, Tensor? row_kv, Tensor? row_valid, "
      "Tensor sink, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) {
  m.impl("narrow_product", &narrow_product);
  m.impl("indexer_topk", &indexer_topk);
  m.impl("hc_post", &hc_post);
  m.impl("sinkhorn", &sinkhorn);
  m.impl("hc_pre", &hc_pre);
  m.impl("rms_norm", &rms_norm);
  m.impl("swiglu", &swiglu);
  m.impl("tile_product", &tile_product);
  m.impl("dense_product", &dense_product);
  m.impl("dense_grouped_product", &dense_grouped_product);
  m.impl("merge_row_keys", &merge_row_keys);
  m.impl("tile_attention", &tile_attention);
  m.impl("group_attention", &group_attention);
}

TORCH_LIBRARY_IMPL(nextn_cpu, CatchAll, m) { m.impl("tile_ready", &tile_ready); }
