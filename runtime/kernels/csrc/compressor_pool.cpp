// SPDX-License-Identifier: Apache-2.0
// nextn_cpu::compressor_pool: DeepSeek-V4's compressor pooling of each block's state rows
// into one entry (runtime/kernels/compressor_pool.py; built with nextn_cpu.cpp into one
// extension by runtime/kernels/cpu_extension.py).
//
// rows [B, L, 2 W] fp32 (`[kv | gate]`, W = overlap * dim, L = overlap * ratio), valid
// [B, L] bool -> [B, dim] fp32: per entry and channel c, the softmax over the block's rows of
// the gate (rows not valid at -inf) weighting the kv values, where for overlap 2 the first
// `ratio` rows read channel c and the others channel dim + c. The softmax as torch's
// (exp(g - max) / sum), the weighted sum in row order; no valid row gives NaN, as torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

at::Tensor compressor_pool(const at::Tensor& rows, const at::Tensor& valid, int64_t dim,
                           int64_t ratio, int64_t overlap) {
  TORCH_CHECK(overlap == 1 || overlap == 2, "compressor_pool: overlap must be 1 or 2");
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat &&
                  rows.size(1) == overlap * ratio && rows.size(2) == 2 * overlap * dim,
              "compressor_pool: rows must be [B, overlap * ratio, 2 * overlap * dim] fp32");
  TORCH_CHECK(valid.dim() == 2 && valid.scalar_type() == at::kBool &&
                  valid.size(0) == rows.size(0) && valid.size(1) == rows.size(1),
              "compressor_pool: valid must be [B, overlap * ratio] bool");
  const int64_t B = rows.size(0), L = rows.size(1), width = overlap * dim;
  at::Tensor out = at::empty({B, dim}, rows.options());
  if (out.numel() == 0) return out;
  at::Tensor rc = rows.contiguous(), vc = valid.contiguous();
  const float* src = rc.data_ptr<float>();
  const bool* ok = vc.data_ptr<bool>();
  float* dst = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(L);
    for (int64_t b = begin; b < end; ++b) {
      const float* block = src + b * L * 2 * width;
      const bool* v = ok + b * L;
      for (int64_t c = 0; c < dim; ++c) {
        float top = neg_inf;
        for (int64_t j = 0; j < L; ++j) {
          const int64_t channel = (overlap == 2 && j >= ratio ? dim : 0) + c;
          gate[j] = v[j] ? block[j * 2 * width + width + channel] : neg_inf;
          top = std::max(top, gate[j]);
        }
        float total = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          gate[j] = std::exp(gate[j] - top);
          total += gate[j];
        }
        float acc = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          const int64_t channel = (overlap == 2 && j >= ratio ? dim : 0) + c;
          acc += (gate[j] / total) * block[j * 2 * width + channel];
        }
        dst[b * dim + c] = acc;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def("compressor_pool(Tensor rows, Tensor valid, int dim, int ratio, int overlap) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) { m.impl("compressor_pool", &compressor_pool); }
