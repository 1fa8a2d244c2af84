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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

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

#if defined(NARROW_AVX512) || defined(NARROW_AVX2)
// out rows `o[m]` (columns n0 .. n0 + Cols) for the `M` input rows `x[m]` (compile-time,
// so the accumulators stay in registers) and the `Cols` weight rows from `w`
template <int M, int Cols>
inline void block(const float* const* x, const uint16_t* w, int64_t K, float* const* o,
                  int64_t n0) {
  VecF acc[M][Cols];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < Cols; ++c) acc[m][c] = zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    VecF wv[Cols];
    for (int c = 0; c < Cols; ++c) wv[c] = widen(w + c * K + k);
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
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < Cols; ++c) o[m][n0 + c] = hsum(acc[m][c]);
}

template <int M>
void rows_times_weight(const float* const* x, const uint16_t* w, int64_t K, float* const* o,
                       int64_t n_begin, int64_t n_end) {
  // at most 16 accumulators, so more weight rows per pass for fewer input rows
  constexpr int Cols = M <= 4 ? 4 : 2;
  int64_t n = n_begin;
  for (; n + Cols <= n_end; n += Cols) block<M, Cols>(x, w + n * K, K, o, n);
  for (; n < n_end; ++n) block<M, 1>(x, w + n * K, K, o, n);
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
                       int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += bf16_to_float(w[n * K + k]) * x[m][k];
      o[m][n] = acc;
    }
}
#endif

using Kernel = void (*)(const float* const*, const uint16_t*, int64_t, float* const*, int64_t,
                        int64_t);

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
        kernel_for(rows)(xrows.data() + row, w, K, orows.data() + row, n0, n1);
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

}  // namespace

TORCH_LIBRARY(nextn_cpu, m) {
  m.def("narrow_product(Tensor x, Tensor weight, Tensor? index=None) -> Tensor");
  m.def("indexer_topk(Tensor scores, Tensor lengths, Tensor visible, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) {
  m.impl("narrow_product", &narrow_product);
  m.impl("indexer_topk", &indexer_topk);
}
