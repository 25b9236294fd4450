#pragma once
// A model's and an optimizer's state as the state dict, full checkpoint and sharded
// checkpoint functions read and write it.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <optional>
#include <set>
#include <string>

#include "full_tensor_source.h"

namespace hp::detail {

// The entries of `source` that load_model_state reads for `model`, once it checked that
// every parameter and buffer has one of its whole shape (c10::ValueError naming `caller`).
std::set<std::string> model_entries(torch::nn::Module& model, const FullTensorSource& source,
                                    const std::string& caller);

// Every parameter and buffer of `model` from `source`. Names and shapes are checked
// completely before anything changes (strict: also that model_entries are all of
// `source`); then each tensor is read, one at a time, and each rank keeps only its part.
// Errors name `caller`.
void load_model_state(torch::nn::Module& model, const FullTensorSource& source, bool strict,
                      const std::string& caller);

// The entries of `source` that load_optimizer_state reads, their shapes checked.
std::set<std::string> optimizer_entries(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const FullTensorSource& source, const std::string& caller);

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
