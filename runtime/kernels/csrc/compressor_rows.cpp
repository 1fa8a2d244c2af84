// SPDX-License-Identifier: Apache-2.0
// nextn_cpu::compressor_rows: DeepSeek-V4's compressor state rows in one pass
// (runtime/kernels/compressor_rows.py; built with nextn_cpu.cpp into one extension by
// runtime/kernels/cpu_extension.py).
//
// kv_gate [T, 2 W] (the fused projection's output, any float dtype), ape [ratio, W] fp32,
// positions [T] int64 -> [T, 2 W] fp32: `[kv | gate + ape[position mod ratio]]`, kv and gate
// widened to fp32 first (one rounding, the torch form's).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

at::Tensor compressor_rows(const at::Tensor& kv_gate, const at::Tensor& ape,
                           const at::Tensor& positions) {
  TORCH_CHECK(ape.dim() == 2 && ape.scalar_type() == at::kFloat && ape.size(0) > 0,
              "compressor_rows: ape must be [ratio, W] fp32");
  const int64_t ratio = ape.size(0), W = ape.size(1);
  TORCH_CHECK(kv_gate.dim() == 2 && kv_gate.size(1) == 2 * W,
              "compressor_rows: kv_gate must be [T, 2 W]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == kv_gate.size(0) &&
                  positions.scalar_type() == at::kLong,
              "compressor_rows: positions must be [T] int64");
  const int64_t T = kv_gate.size(0);
  at::Tensor out = at::empty({T, 2 * W}, kv_gate.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  at::Tensor xc = kv_gate.contiguous(), ac = ape.contiguous(), pc = positions.contiguous();
  const float* a = ac.data_ptr<float>();
  const int64_t* pos = pc.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "compressor_rows",
                                  [&] {
    const scalar_t* x = xc.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        // Python's modulo (the torch form's `%`): never negative for a positive ratio
        const int64_t slot = ((pos[t] % ratio) + ratio) % ratio;
        const scalar_t* row = x + t * 2 * W;
        const float* bias = a + slot * W;
        float* dst = o + t * 2 * W;
        for (int64_t d = 0; d < W; ++d) dst[d] = static_cast<float>(row[d]);
        for (int64_t d = 0; d < W; ++d) dst[W + d] = static_cast<float>(row[W + d]) + bias[d];
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def("compressor_rows(Tensor kv_gate, Tensor ape, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) { m.impl("compressor_rows", &compressor_rows); }
