#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <utility>
#include <vector>

#include "hyperparallel/fully_shard.h"

namespace hp::detail {

class FSDPState;
class FSDPParam;

// Makes and reads FSDPModule, whose constructor and state are private to the library.
struct FSDPModuleAccess {
  static FSDPModule make(std::shared_ptr<FSDPState> state) { return FSDPModule(std::move(state)); }
  static const std::shared_ptr<FSDPState>& state(const FSDPModule& module) { return module.state_; }
};

// Every live state (for checks across fully_shard calls).
std::vector<std::shared_ptr<FSDPState>> all_states();

// The fully_shard state of a module, or null.
std::shared_ptr<FSDPState> state_of(const torch::nn::Module* module);

// The live state sharding the parameter `variable` and its FSDPParam; {null, null} when
// none does.
std::pair<std::shared_ptr<FSDPState>, FSDPParam*> find_fsdp_param(const at::Tensor& variable);

// Throws if the module already has a state.
void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    std::shared_ptr<FSDPState> state);

}  // namespace hp::detail
