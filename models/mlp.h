#pragma once
// A small residual MLP for tests: input projection, residual blocks, output head.
// Sizes are deliberately uneven (7x5, 9x7, ...) so sharding pads on 2, 3 and 4 ranks.
// The blocks are declared Sharded<...>: without fully_shard they are plain modules,
// so the same class is also the single-process reference.

#include <torch/torch.h>

#include <vector>

#include "hyperparallel/fully_shard.h"

namespace hp::models {

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t dim, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpBlock);

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t dim, int64_t hidden, int64_t out, int64_t num_blocks)
      : input(register_module("input", torch::nn::Linear(in, dim))) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < num_blocks; ++i) {
      blocks.emplace_back(MlpBlock(dim, hidden));
      list->push_back(blocks.back().ptr());
    }
    head = register_module("head", torch::nn::Linear(dim, out));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = input(x);
    for (auto& block : blocks) h = block(h);
    return head(h);
  }
  torch::nn::Linear input;
  std::vector<hp::Sharded<MlpBlock>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace hp::models
