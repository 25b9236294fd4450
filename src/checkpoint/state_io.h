#pragma once
// A model's and an optimizer's state as the state dict, full checkpoint and sharded
// checkpoint functions read and write it.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <optional>
#include <string>

#include "full_tensor_source.h"

namespace hp::detail {

// Every parameter and buffer of `model` from `source`. Names and shapes are checked
// completely before anything changes; then each tensor is read, one at a time, and each
// rank keeps only its part. Errors name `caller`.
void load_model_state(torch::nn::Module& model, const FullTensorSource& source, bool strict,
                      const std::string& caller);

// The optimizer's per-parameter state of `model`'s parameters from `source` (entries
// named like get_full_optimizer_state_dict's).
void load_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const FullTensorSource& source, bool strict, const std::string& caller);

// The per-parameter state `optimizer` keeps for `param`, as this rank holds it (shaped
// like the local shard): fields named as in get_full_optimizer_state_dict, and the step
// for optimizers that count them. Unset when it has no state for `param` (yet).
struct ParamOptimizerState {
  std::optional<int64_t> step;
  std::map<std::string, at::Tensor> fields;
};
std::optional<ParamOptimizerState> optimizer_state_of(torch::optim::Optimizer& optimizer,
                                                      const at::Tensor& param);

}  // namespace hp::detail
