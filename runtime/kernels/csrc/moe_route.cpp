// SPDX-License-Identifier: Apache-2.0
// nextn_cpu::moe_route: the MoE router's expert selection (runtime/kernels/moe_route.py;
// built with nextn_cpu.cpp into one extension by runtime/kernels/cpu_extension.py).
//
// The op body of moe_route.py's reference as the same ATen calls, so that a captured step
// holds the router as one node (called by inductor's C++ wrapper without Python) with the
// eager values bit for bit: scores by the scoring function, the top k of scores + bias (or
// the hash table's ids), the selected scores renormalised and scaled.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits,
                                             const c10::optional<at::Tensor>& bias,
                                             const c10::optional<at::Tensor>& hash_ids,
                                             int64_t top_k, c10::string_view scoring,
                                             bool renormalize, double scale) {
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits must be [T, E]");
  const at::Tensor x = logits.to(at::kFloat);
  at::Tensor scores;
  if (scoring == "sqrtsoftplus") {
    scores = at::softplus(x, 1, 20).sqrt();
  } else if (scoring == "sigmoid") {
    scores = x.sigmoid();
  } else if (scoring == "softmax") {
    scores = x.softmax(-1);
  } else {
    TORCH_CHECK(false, "moe_route: unsupported scoring function ", scoring);
  }
  at::Tensor ids;
  if (hash_ids.has_value()) {
    // a new tensor even where the ids are int64 already (an op's output may not alias its
    // input: a compiled step would reuse the buffers as if they were distinct)
    ids = hash_ids->scalar_type() == at::kLong ? hash_ids->clone() : hash_ids->to(at::kLong);
  } else {
    const at::Tensor ranked = bias.has_value() ? scores + bias->to(at::kFloat) : scores;
    ids = std::get<1>(at::topk(ranked, top_k, -1, true, false));
  }
  at::Tensor weights = scores.gather(1, ids);
  if (renormalize) weights = weights / (weights.sum(-1, true) + 1e-20);
  return {weights * scale, ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn_cpu, m) {
  m.def(
      "moe_route(Tensor logits, Tensor? bias, Tensor? hash_ids, int top_k, str scoring, "
      "bool renormalize, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nextn_cpu, CPU, m) { m.impl("moe_route", &moe_route); }
