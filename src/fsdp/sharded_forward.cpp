// The forward hooks hp::Sharded runs around a module call, and a module's FSDP interface.
#include <c10/util/Exception.h>

#include "fsdp_state.h"
#include "hyperparallel/fully_shard.h"
#include "state_registry.h"

namespace hp::detail {

ForwardHooks::ForwardHooks(const torch::nn::Module* module) : state_(state_of(module)) {}

ForwardHooks::~ForwardHooks() {
  if (forward_running_) state_->forward_failed();
}

void ForwardHooks::before(const std::vector<at::Tensor*>& inputs) {
  state_->pre_forward(inputs);
  forward_running_ = true;
}

void ForwardHooks::after(const std::vector<at::Tensor*>& outputs) {
  forward_running_ = false;  // post_forward keeps the state consistent itself
  state_->post_forward(outputs);
}

FSDPModule fsdp_module_of(const torch::nn::Module* module) {
  auto state = state_of(module);
  if (!state) {
    C10_THROW_ERROR(Error,
                    "this module was not fully_shard-ed; call hp::fully_shard(module) "
                    "before using its FSDP interface");
  }
  return FSDPModuleAccess::make(std::move(state));
}

}  // namespace hp::detail
