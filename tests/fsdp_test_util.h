#pragma once
// Helpers for fully_shard tests: compare a sharded model with the single-process
// reference by fully qualified parameter names.

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "hyperparallel/fully_shard.h"

namespace hp::testing {

// A fully_shard-ed module and the prefix of its parameters' names in the whole model.
using ShardedParts = std::vector<std::pair<std::string, FSDPModule>>;

// fully_shard every block (its names prefixed "<prefix><i>."), then the root, with the
// same options; the root comes last in the result.
template <typename Block, typename Root>
ShardedParts shard_blocks_then_root(std::vector<Sharded<Block>>& blocks, Sharded<Root>& root,
                                    const std::string& prefix,
                                    const FullyShardOptions& options = {}) {
  ShardedParts parts;
  for (size_t i = 0; i < blocks.size(); ++i) {
    parts.emplace_back(prefix + std::to_string(i) + ".", fully_shard(blocks[i], options));
  }
  parts.emplace_back("", fully_shard(root, options));
  return parts;
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

}  // namespace hp::testing
