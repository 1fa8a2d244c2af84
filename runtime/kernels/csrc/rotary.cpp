// SPDX-License-Identifier: Apache-2.0
// nextn_cpu::rotary: rotary position embedding of a slice of each head's channels in one
// pass (runtime/kernels/rotary.py; built with nextn_cpu.cpp into one extension by
// runtime/kernels/cpu_extension.py).
//
// x [T, D] or [T, H, D] (fp32, bf16 or fp16), cos and sin [T, R / 2] fp32 -> out shaped as
// x, contiguous: channels lo .. lo + R rotated by the token's angles (pairs (2k, 2k + 1)
// when interleaved, else (k, k + R / 2)), inverse rotating by -angle; the other channels
// copied. The rotation in fp32, `x1 cos - x2 sin, x2 cos + x1 sin` as the torch form
// writes it, rounded once to x's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

template <typename scalar_t>
void rotate_rows(const scalar_t* src, scalar_t* dst, const float* cos, const float* sin,
                 int64_t rows, int64_t heads, int64_t D, int64_t lo, int64_t half,
                 bool interleaved, bool inverse) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads;
      const scalar_t* x = src + r * D;
      scalar_t* o = dst + r * D;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t d = 0; d < lo; ++d) o[d] = x[d];
      for (int64_t d = lo + 2 * half; d < D; ++d) o[d] = x[d];
      const int64_t step = interleaved ? 2 : 1;        // from one pair's first to the next's
      const int64_t partner = interleaved ? 1 : half;  // from a pair's first to its second
      for (int64_t k = 0; k < half; ++k) {
        const int64_t i = lo + k * step;
        const float x1 = static_cast<float>(x[i]);
        const float x2 = static_cast<float>(x[i + partner]);
        const float ck = c[k];
        const float sk = inverse ? -s[k] : s[k];
        o[i] = static_cast<scalar_t>(x1 * ck - x2 * sk);
        o[i + partner] = static_cast<scalar_t>(x2 * ck + x1 * sk);
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t lo, bool interleaved, bool inverse) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rotary: x must be [T, D] or [T, H, D]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary: cos and sin must be [T, R / 2] fp32");
  const int64_t T = x.size(0), D = x.size(-1), half = cos.size(1);
  TORCH_CHECK(lo >= 0 && lo + 2 * half <= D, "rotary: the rotated slice must lie in x's rows");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1;
  at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                          cc.data_ptr<float>(), sc.data_ptr<float>(), T * heads, heads, D, lo,
                          half, interleaved, inverse);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int lo, bool interleaved, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) { m.impl("rotary", &rotary); }
