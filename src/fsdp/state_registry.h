#pragma once

#include <torch/nn/module.h>

#include <memory>

namespace hp::detail {

class FSDPState;

// Throws if the module already has a state.
void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    std::shared_ptr<FSDPState> state);

}  // namespace hp::detail
