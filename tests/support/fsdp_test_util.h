#pragma once
// Helpers for fully_shard tests: compare a sharded model with the single-process
// reference by fully qualified parameter names.

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "distributed_test.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/fully_shard.h"

namespace hp::testing {

// A fully_shard-ed module and the prefix of its parameters' names in the whole model.
using ShardedParts = std::vector<std::pair<std::string, FSDPModule>>;

// The single-process reference and the model to shard, built from the same seed so that
// they start with equal parameters.
template <typename Model>
struct ReferenceAndModel {
  Model reference;
  Sharded<Model> model;
};

template <typename Model, typename... Args>
ReferenceAndModel<Model> build_from_seed(uint64_t seed, const Args&... args) {
  torch::manual_seed(seed);
  Model reference(args...);
  torch::manual_seed(seed);
  Sharded<Model> model(args...);
  return {reference, model};
}

// fully_shard every block (its names prefixed "<prefix><i>.") with `block_options`, then
// the root with `root_options`; the root comes last in the result.
template <typename Block, typename Root>
ShardedParts shard_blocks_then_root(std::vector<Sharded<Block>>& blocks, Sharded<Root>& root,
                                    const std::string& prefix,
                                    const FullyShardOptions& block_options,
                                    const FullyShardOptions& root_options) {
  ShardedParts parts;
  for (size_t i = 0; i < blocks.size(); ++i) {
    parts.emplace_back(prefix + std::to_string(i) + ".", fully_shard(blocks[i], block_options));
  }
  parts.emplace_back("", fully_shard(root, root_options));
  return parts;
}

// The same, with one set of options for blocks and root.
template <typename Block, typename Root>
ShardedParts shard_blocks_then_root(std::vector<Sharded<Block>>& blocks, Sharded<Root>& root,
                                    const std::string& prefix,
                                    const FullyShardOptions& options = {}) {
  return shard_blocks_then_root(blocks, root, prefix, options, options);
}

inline std::map<std::string, at::Tensor> full_grads(const ShardedParts& parts) {
  std::map<std::string, at::Tensor> grads;
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      grads[prefix + info.name] = module.full_grad(info.name);
    }
  }
  return grads;
}

inline std::map<std::string, at::Tensor> full_params(const ShardedParts& parts) {
  std::map<std::string, at::Tensor> params;
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      params[prefix + info.name] = module.full_tensor(info.name);
    }
  }
  return params;
}

inline double norm_of(const std::map<std::string, at::Tensor>& tensors) {
  double sum = 0;
  for (const auto& [name, t] : tensors) {
    if (t.defined()) sum += t.to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

inline std::map<std::string, at::Tensor> reference_grads(torch::nn::Module& reference) {
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : reference.named_parameters()) grads[item.key()] = item.value().grad();
  return grads;
}

inline std::map<std::string, at::Tensor> reference_params(torch::nn::Module& reference) {
  std::map<std::string, at::Tensor> params;
  for (const auto& item : reference.named_parameters()) params[item.key()] = item.value().detach();
  return params;
}

// The largest element-wise difference of two tensors, in double.
inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The largest difference over the names of `expected`, which `actual` must all have with
// the same shapes (else a test failure); `where`, if given, gets the name.
inline double max_abs_diff(const std::map<std::string, at::Tensor>& actual,
                           const std::map<std::string, at::Tensor>& expected,
                           std::string* where = nullptr) {
  double largest = 0;
  for (const auto& [name, want] : expected) {
    auto found = actual.find(name);
    EXPECT_NE(found, actual.end()) << "no " << name;
    if (found == actual.end()) continue;
    EXPECT_EQ(found->second.sizes(), want.sizes()) << name;
    if (found->second.sizes() != want.sizes() || !want.defined()) continue;
    const double diff = max_abs_diff(found->second, want);
    if (diff >= largest) {
      largest = diff;
      if (where) *where = name;
    }
  }
  return largest;
}

// Every name of `expected` must be in `actual` with all elements within atol.
inline void expect_all_close(const std::map<std::string, at::Tensor>& actual,
                             const std::map<std::string, at::Tensor>& expected, double atol,
                             const std::string& what) {
  for (const auto& [name, want] : expected) {
    auto found = actual.find(name);
    ASSERT_NE(found, actual.end()) << what << ": no " << name;
    const at::Tensor& got = found->second;
    ASSERT_EQ(got.defined(), want.defined()) << what << " " << name;
    if (!want.defined()) continue;
    ASSERT_EQ(got.sizes(), want.sizes()) << what << " " << name;
    const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, atol) << what << " " << name << ": max abs difference " << diff;
  }
}

// This data-parallel rank's slice of a global batch.
inline at::Tensor local_batch(const at::Tensor& global, int64_t rank, int64_t ranks) {
  return global.chunk(ranks, 0)[rank];
}

// This rank's value averaged over all ranks, in the value's own dtype.
inline at::Tensor mean_over_ranks(const at::Tensor& value) {
  at::Tensor mean = value.detach().clone();
  all_reduce(mean, ReduceOp::kAvg, *world()->world_group()).wait();
  return mean;
}

// torch::mse_loss with its defaults, as a function that can be passed as a loss.
inline at::Tensor mse_loss(const at::Tensor& output, const at::Tensor& target) {
  return torch::mse_loss(output, target);
}

// Next-token loss: logits [batch, seq, vocab] against target token ids [batch, seq].
inline at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              target.reshape(-1));
}

// What an A/A rerun must reproduce bit for bit: a step's mean loss and grad norm.
struct StepResult {
  float loss;
  float grad_norm;
};

inline void expect_bitwise_equal(const std::vector<StepResult>& a,
                                 const std::vector<StepResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(StepResult)), 0)
        << "step " << i << ": loss " << a[i].loss << " vs " << b[i].loss << ", grad norm "
        << a[i].grad_norm << " vs " << b[i].grad_norm;
  }
}

// How far a sharded step was from the single-process reference's.
struct ReferenceStepDiffs {
  double loss = 0, grad_norm = 0, grad = 0;
};

// One step of the single-process `reference` on the global batch (next-token loss; its
// gradients left for its optimizer), checked against the sharded run's mean loss and
// whole gradients: loss, grad norm and every gradient within `atol`.
template <typename Reference>
ReferenceStepDiffs expect_reference_step_matches(Reference& reference, const at::Tensor& input,
                                                 const at::Tensor& target, double mean_loss,
                                                 const std::map<std::string, at::Tensor>& grads,
                                                 double atol) {
  reference->zero_grad();
  at::Tensor ref_loss = token_cross_entropy(reference(input), target);
  ref_loss.backward();
  const auto ref_grads = reference_grads(*reference);
  EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters managed by fully_shard";
  const ReferenceStepDiffs diffs{std::abs(mean_loss - ref_loss.item<double>()),
                                 std::abs(norm_of(grads) - norm_of(ref_grads)),
                                 max_abs_diff(grads, ref_grads)};
  EXPECT_LE(diffs.loss, atol) << "loss";
  EXPECT_LE(diffs.grad_norm, atol) << "grad norm";
  expect_all_close(grads, ref_grads, atol, "grad");
  return diffs;
}

struct StepLosses {
  at::Tensor reference;  // on the whole global batch
  at::Tensor local;      // this rank's, on its share
};

// One backward of each model on the same global batch: `reference` on all of it, `model`
// on this rank's share.
template <typename Reference, typename Model, typename LossFn>
StepLosses backward_on_global_batch(Reference& reference, Model& model, const at::Tensor& input,
                                    const at::Tensor& target, const LossFn& loss_of) {
  auto group = world();
  StepLosses losses;
  losses.reference = loss_of(reference(input), target);
  losses.reference.backward();
  losses.local = loss_of(model(local_batch(input, group->rank(), group->size())),
                         local_batch(target, group->rank(), group->size()));
  losses.local.backward();
  return losses;
}

// `steps` AdamW steps (lr 1e-2) of `reference` on whole global batches and of `model`
// (sharded as `parts`) on this rank's shares, each batch from `next_batch()` as
// {input, target}. After each backward the mean loss, the global grad norm and every
// gradient, after each step every parameter, must match within `tol`.
// `expect_every_param_managed`: also as many sharded gradients as reference parameters.
template <typename Reference, typename Model, typename NextBatch, typename LossFn>
void expect_training_matches_reference(Reference& reference, Model& model,
                                       const ShardedParts& parts, int steps,
                                       const NextBatch& next_batch, const LossFn& loss_of,
                                       double tol, bool expect_every_param_managed = false) {
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto [input, target] = next_batch();
    ref_opt.zero_grad();
    opt.zero_grad();
    const StepLosses losses = backward_on_global_batch(reference, model, input, target, loss_of);

    EXPECT_NEAR(mean_over_ranks(losses.local).item<double>(), losses.reference.item<double>(), tol)
        << "loss";
    auto grads = full_grads(parts);
    auto ref_grads = reference_grads(*reference);
    if (expect_every_param_managed) {
      EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters managed by fully_shard";
    }
    EXPECT_NEAR(norm_of(grads), norm_of(ref_grads), tol) << "grad norm";
    expect_all_close(grads, ref_grads, tol, "grad");

    ref_opt.step();
    opt.step();
    expect_all_close(full_params(parts), reference_params(*reference), tol, "param after step");
  }
}

}  // namespace hp::testing
