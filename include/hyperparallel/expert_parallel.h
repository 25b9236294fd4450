#pragma once
// Expert parallelism: a mixture-of-experts layer (MoE) whose experts are partitioned over
// the ranks of an expert-parallel group, tokens travelling to their experts and back by
// all-to-all. Composes with fully_shard: the experts are their own Sharded module, so
// they can be fully_shard-ed over the data-parallel ranks orthogonal to the expert group
// while the rest of the model is sharded over all data-parallel ranks.
//
//   // 4 ranks: mesh {dp_shard: 2, ep: 2}; dense parameters over all 4 ranks.
//   hp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"ep", 2}});
//   hp::MoE moe(options, mesh.group("ep"));
//   hp::fully_shard(moe->experts, {.mesh = mesh.slice({"dp_shard"})})
//       .set_gradient_divide_factor(4);  // dp_shard x ep: see below
//   ... fully_shard(block containing moe, {.mesh = DeviceMesh(world, {{"dp", 4}})}) ...
//
// Routing (per token): probabilities = softmax(router(x)) in fp32 over all experts; the
// top_k experts by probability, ties going to the lower expert index (a stable sort);
// gate weights = the top_k probabilities renormalized to sum to 1 (Mixtral). Output =
// sum over the token's kept slots of gate x expert(x); a dropped slot adds nothing (the
// block's residual carries the token).
//
// Slots: token t's j-th choice is slot t * top_k + j ("token order"). Capacity, when
// capacity_factor is set: every expert takes at most
//   C = ceil(capacity_factor * N * top_k / num_experts)
// slots from each source rank, N = the tokens of that rank's input (all dims but the
// last); of the slots routed to an expert, the first C in token order are kept, the later
// ones dropped. Without capacity_factor nothing is dropped.
//
// Load balancing (Switch Transformer), when load_balance_coef > 0, over this rank's
// tokens: aux = load_balance_coef * num_experts * sum_e f_e * P_e, f_e = the fraction of
// the N * top_k slots routed to expert e (before capacity drops, no gradient), P_e = the
// mean routing probability of expert e. Read it with aux_loss() after forward and add it
// to the loss.
//
// Gradients with fully_shard: the global loss is the mean of the ranks' losses, and an
// expert's gradient on its ep rank already sums the contributions of the tokens every
// rank of the ep group sent it. Reducing it over the data-parallel ranks of that expert
// (dp_shard, and dp_replicate if any) therefore needs a divide factor of all data ranks:
// dp_replicate x dp_shard x ep (set_gradient_divide_factor); the dense parameters keep
// fully_shard's average over their dp_shard x ep ranks.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/process_group.h"

namespace hp {

// input's rows are sent to the ranks of `group`, input_splits[r] rows to group rank r (in
// order); output_splits[s] rows come from group rank s. Differentiable: backward sends
// the gradients back by the inverse exchange (the splits swapped). On a group of size 1
// the input is returned as it is.
at::Tensor all_to_all_rows(const at::Tensor& input, const GroupPtr& group,
                           std::vector<int64_t> output_splits, std::vector<int64_t> input_splits);

struct MoEOptions {
  int64_t dim = 0;            // token width
  int64_t expert_hidden = 0;  // SwiGLU hidden width of each expert
  int64_t num_experts = 0;
  int64_t top_k = 2;
  std::optional<double> capacity_factor;  // > 0; unset: no capacity, nothing dropped
  double load_balance_coef = 0;           // >= 0; 0: no auxiliary loss

  // Throws c10::ValueError naming the bad field.
  void validate() const;
};

// The experts [first_expert, first_expert + local_experts) of num_experts SwiGLU MLPs
// (expert e: w2[e] (silu(w1[e] x) * w3[e] x)), each weight stacked over the local experts
// as one parameter, shaped like the Linear weights: w1, w3 [local, hidden, dim], w2
// [local, dim, hidden].
struct ExpertsImpl : torch::nn::Module {
  // Group rank r of `ep_group` (null: all experts local) holds experts [r * E / ep,
  // (r + 1) * E / ep), its weights declared as slices of the whole [E, ...] tensors
  // (parallel_slice.h). Initialized like Linear (uniform +-1/sqrt(fan_in)), drawn for all
  // num_experts and sliced (see init_normal): the same seed gives every ep size the same
  // experts.
  ExpertsImpl(int64_t dim, int64_t hidden, int64_t num_experts, const GroupPtr& ep_group = nullptr);

  // tokens [sum(tokens_per_expert), dim]: the rows of local expert 0, then of local
  // expert 1, ...; returns their outputs in the same order.
  at::Tensor forward(const at::Tensor& tokens, const std::vector<int64_t>& tokens_per_expert);

  // Refills the weights from N(0, in_std) (w1, w3) and N(0, out_std) (w2), drawing the
  // whole [num_experts, ...] tensors from the default generator and keeping this rank's
  // slice, so that the draws and the generator's state after them do not depend on the
  // ep size. Needs the whole tensors in memory for a moment.
  void init_normal(double in_std, double out_std);

  int64_t num_experts, local_experts, first_expert;
  at::Tensor w1, w3, w2;
};
TORCH_MODULE(Experts);

// How the tokens of the last forward were routed, per global expert, from this rank.
struct RoutingCounts {
  std::vector<int64_t> routed;  // slots routed to the expert
  std::vector<int64_t> kept;    // of those, the ones within capacity
};

struct MoEImpl : torch::nn::Module {
  // ep_group null or of size 1: all experts local, no communication (the single-process
  // reference). Otherwise group rank r holds experts [r * E / ep, (r + 1) * E / ep) and
  // every rank of the group must run forward and backward together.
  explicit MoEImpl(const MoEOptions& options, GroupPtr ep_group = nullptr);

  // x [..., dim] -> [..., dim].
  at::Tensor forward(const at::Tensor& x);

  // The load-balancing loss of the last forward (coefficient applied, with its graph), a
  // scalar; an fp32 zero without graph when load_balance_coef is 0; undefined before the
  // first forward. A forward without autograd leaves it without graph too, as inside a
  // reentrant recompute region: return it from the region as one of its outputs
  // (models::run_block does), or it trains nothing.
  const at::Tensor& aux_loss() const;
  const RoutingCounts& routing_counts() const { return routing_counts_; }

  MoEOptions options;
  GroupPtr ep_group;
  torch::nn::Linear router{nullptr};  // dim -> num_experts, no bias; replicated
  Sharded<Experts> experts{nullptr};

 private:
  // tokens [S, dim] grouped by global expert, kept[e] rows for expert e: the experts'
  // outputs in the same order, from wherever the experts live.
  at::Tensor run_experts(const at::Tensor& tokens, const at::Tensor& kept);

  at::Tensor aux_loss_;
  RoutingCounts routing_counts_;
};
TORCH_MODULE(MoE);

}  // namespace hp
