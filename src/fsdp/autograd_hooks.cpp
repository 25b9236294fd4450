#include "autograd_hooks.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include "../distributed/autograd_capsule.h"
#include "fsdp_state.h"

namespace hp::detail {
namespace {

// Carries the state through the autograd context without keeping it alive.
using StateRef = AutogradCapsule<std::weak_ptr<FSDPState>>;

struct PostBackward : torch::autograd::Function<PostBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<StateRef> ref) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(ref));
    torch::autograd::variable_list outputs;
    for (const auto& input : inputs) outputs.push_back(input.view_as(input));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (auto state = StateRef::in(ctx->saved_data["state"]).lock()) {
      state->post_backward_hook_fired();
    }
    grads.emplace_back();  // for the StateRef argument
    return grads;
  }
};

}  // namespace

void register_pre_backward_hooks(const std::vector<at::Tensor*>& outputs,
                                 const std::weak_ptr<FSDPState>& state) {
  for (at::Tensor* output : outputs) {
    if (!output->defined() || !output->requires_grad()) continue;
    output->register_hook([state](const at::Tensor&) {
      if (auto s = state.lock()) s->pre_backward();
    });
  }
}

bool register_post_backward_hook(const std::vector<at::Tensor*>& inputs,
                                 const std::weak_ptr<FSDPState>& state) {
  torch::autograd::variable_list needing_grad;
  std::vector<at::Tensor*> targets;
  for (at::Tensor* input : inputs) {
    if (input->defined() && input->requires_grad()) {
      needing_grad.push_back(*input);
      targets.push_back(input);
    }
  }
  if (needing_grad.empty()) return false;  // the root's end-of-backward callback covers it
  // As a TensorList (not a vector) so that autograd records the tensors as inputs.
  auto outputs =
      PostBackward::apply(at::TensorList(needing_grad), c10::make_intrusive<StateRef>(state));
  for (size_t i = 0; i < targets.size(); ++i) *targets[i] = outputs[i];
  return true;
}

void queue_end_of_backward_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace hp::detail
