#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace hp::detail {

class FSDPState;

// Every live state (for checks across fully_shard calls).
std::vector<std::shared_ptr<FSDPState>> all_states();

// Throws if the module already has a state.
void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    std::shared_ptr<FSDPState> state);

}  // namespace hp::detail
