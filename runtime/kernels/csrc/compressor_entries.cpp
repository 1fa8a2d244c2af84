// SPDX-License-Identifier: Apache-2.0
// nextn_cpu::compressor_entries: DeepSeek-V4's compressed entries from their blocks' state
// rows in one call (runtime/kernels/compressor_entries.py; built with nextn_cpu.cpp into one
// extension by runtime/kernels/cpu_extension.py): the pooling (nextn_cpu::compressor_pool),
// the RMSNorm (nextn_cpu::rms_norm), the rotary table at the entries' positions (the same
// ATen calls as RotaryEmbedding.cos_sin) and the rotation (nextn_cpu::rotary), so that the
// values are those of the four steps taken one by one.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor compressor_entries(const at::Tensor& rows, const at::Tensor& valid,
                              const at::Tensor& norm_weight, double eps,
                              const at::Tensor& positions, const at::Tensor& inv_freq,
                              double scaling, int64_t dim, int64_t ratio, int64_t overlap,
                              int64_t lo, bool interleaved) {
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows.size(0) &&
                  inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat,
              "compressor_entries: positions must be [B] and inv_freq [R / 2] fp32");
  static auto pool = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("nextn_cpu::compressor_pool", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                           int64_t, int64_t)>();
  static auto norm =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("nextn_cpu::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double)>();
  static auto rotate = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("nextn_cpu::rotary", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, int64_t, bool, bool)>();
  const at::Tensor pooled = pool.call(rows, valid, dim, ratio, overlap);
  const at::Tensor normed = norm.call(pooled, norm_weight.to(at::kFloat), eps);
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;
  return rotate.call(normed, freqs.cos() * scaling, freqs.sin() * scaling, lo, interleaved,
                     false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def(
      "compressor_entries(Tensor rows, Tensor valid, Tensor norm_weight, float eps, "
      "Tensor positions, Tensor inv_freq, float scaling, int dim, int ratio, int overlap, "
      "int lo, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) { m.impl("compressor_entries", &compressor_entries); }
