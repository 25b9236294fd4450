#pragma once
// The three places fully_shard hooks into autograd:
//  - pre-backward: a hook on each forward output, run when its gradient is ready,
//    i.e. before the module's own backward;
//  - post-backward: an identity function over the module's inputs, whose backward runs
//    once the gradients of those inputs — and so of the module's parameters — exist;
//  - end of backward: a callback queued on the engine by the root.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace hp::detail {

class FSDPState;

void register_pre_backward_hooks(const std::vector<at::Tensor*>& outputs,
                                 const std::weak_ptr<FSDPState>& state);
// Replaces the inputs that require grad by identity views whose backward calls
// state->post_backward_hook_fired(). False when no input requires grad.
bool register_post_backward_hook(const std::vector<at::Tensor*>& inputs,
                                 const std::weak_ptr<FSDPState>& state);
// Only valid while a backward pass runs.
void queue_end_of_backward_callback(std::function<void()> callback);

}  // namespace hp::detail
