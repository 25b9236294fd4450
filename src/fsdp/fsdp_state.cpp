#include "fsdp_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <stdexcept>

#include "autograd_hooks.h"

namespace hp::detail {
namespace {

void cast_floating(const std::vector<at::Tensor*>& tensors, c10::ScalarType dtype) {
  for (at::Tensor* t : tensors) {
    if (t->defined() && at::isFloatingType(t->scalar_type()) && t->scalar_type() != dtype) {
      *t = t->to(dtype);
    }
  }
}

template <typename Visit>
void for_each_live(const std::vector<std::weak_ptr<FSDPState>>& states, Visit visit) {
  for (const auto& weak : states) {
    if (auto state = weak.lock()) visit(*state);
  }
}

}  // namespace

FSDPState::FSDPState(std::unique_ptr<ParamGroup> group, MixedPrecisionPolicy mp,
                     std::optional<bool> reshard_after_forward,
                     std::function<std::vector<StatePtr>()> subtree)
    : group_(std::move(group)),
      mp_(mp),
      reshard_after_forward_(reshard_after_forward),
      subtree_(std::move(subtree)) {}

bool FSDPState::reshard_after_forward() const {
  return reshard_after_forward_.value_or(!is_root());
}

void FSDPState::set_reduce_op(ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw std::invalid_argument("gradients are reduced with \"sum\" or \"avg\", not \"" +
                                to_string(op) + "\"");
  }
  reduce_op_ = op;
}

void FSDPState::set_gradient_divide_factor(double factor) {
  if (!(factor > 0)) {
    throw std::invalid_argument("gradient divide factor must be positive, got " +
                                std::to_string(factor));
  }
  divide_factor_ = factor;
}

void FSDPState::set_is_last_backward(bool value) {
  if (initialized() && !is_root()) {
    throw std::logic_error(
        "set_is_last_backward applies to the root (the outermost "
        "fully_shard-ed module of the forward); call it there");
  }
  is_last_backward_ = value;
  is_last_backward_set_ = true;
}

void FSDPState::set_forward_prefetch(std::vector<StatePtr> states) {
  forward_prefetch_.assign(states.begin(), states.end());
}

void FSDPState::set_backward_prefetch(std::vector<StatePtr> states) {
  backward_prefetch_.assign(states.begin(), states.end());
}

ReduceSettings FSDPState::reduce_settings() const {
  ReduceSettings settings;
  settings.sync = requires_gradient_sync_;
  settings.all_reduce = requires_all_reduce_;
  const auto& comm = group_->comm();
  const double data_parallel = static_cast<double>(comm.shard->size() * comm.replicate->size());
  settings.divide_factor =
      divide_factor_.value_or(reduce_op_ == ReduceOp::kAvg ? data_parallel : 1.0);
  return settings;
}

void FSDPState::lazy_init_as_root() {
  std::vector<StatePtr> driven;
  for (const StatePtr& state : subtree_()) {
    // A state already driven by another root keeps it (it is used standalone).
    if (state.get() != this && state->initialized() && !state->is_root()) continue;
    if (state.get() != this && state->is_last_backward_set_) {
      throw std::logic_error(
          "set_is_last_backward was called on a module that turned out not "
          "to be the root; call it on the root module");
    }
    driven.push_back(state);
  }
  for (const StatePtr& state : driven) {
    state->root_ = weak_from_this();
    tree_.push_back(state);
  }
}

void FSDPState::finish_pending_reductions() { group_->finish_reduce(); }

void FSDPState::pre_forward(const std::vector<at::Tensor*>& inputs) {
  if (!initialized()) lazy_init_as_root();
  if (forward_depth_++ > 0) return;  // another module of this state is mid-forward
  if (is_root()) {
    for_each_live(tree_, [](FSDPState& s) { s.post_backward_hooks_pending_ = 0; });
    // Reductions left pending by a backward with set_is_last_backward(false) finish
    // before parameters are used again.
    for_each_live(tree_, [](FSDPState& s) { s.finish_pending_reductions(); });
  }
  group_->unshard(/*async=*/false);
  for_each_live(forward_prefetch_, [](FSDPState& s) { s.group_->unshard(/*async=*/true); });
  if (mp_.cast_forward_inputs && mp_.param_dtype) cast_floating(inputs, *mp_.param_dtype);
  if (c10::GradMode::is_enabled() && register_post_backward_hook(inputs, weak_from_this())) {
    ++post_backward_hooks_pending_;
  }
}

void FSDPState::post_forward(const std::vector<at::Tensor*>& outputs) {
  if (--forward_depth_ > 0) return;
  if (group_->has_post_forward_group()) {
    group_->reshard_to_post_forward_group();
  } else if (reshard_after_forward()) {
    group_->reshard();
  }
  if (mp_.output_dtype) cast_floating(outputs, *mp_.output_dtype);
  if (c10::GradMode::is_enabled()) register_pre_backward_hooks(outputs, weak_from_this());
}

void FSDPState::pre_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  post_backward_done_ = false;
  if (auto root = root_.lock(); root && !root->final_callback_queued_) {
    root->final_callback_queued_ = true;
    std::weak_ptr<FSDPState> weak_root = root;
    queue_end_of_backward_callback([weak_root] {
      if (auto r = weak_root.lock()) r->root_post_backward_final_callback();
    });
  }
  group_->stash_replicated_grads();
  group_->unshard(/*async=*/false);
  for_each_live(backward_prefetch_, [](FSDPState& s) { s.group_->unshard(/*async=*/true); });
}

void FSDPState::post_backward_hook_fired() {
  if (--post_backward_hooks_pending_ > 0) return;
  post_backward();
}

void FSDPState::post_backward() {
  post_backward_hooks_pending_ = 0;
  if (!in_backward_ || post_backward_done_) return;
  post_backward_done_ = true;
  group_->finish_reduce();  // one left pending by set_is_last_backward(false)
  group_->start_reduce(reduce_settings());
  if (reshard_after_backward_) group_->reshard();
}

void FSDPState::root_post_backward_final_callback() {
  final_callback_queued_ = false;
  // States whose inputs needed no gradient (the root itself, typically) never saw
  // their post-backward hook fire: run it now.
  for_each_live(tree_, [](FSDPState& s) { s.post_backward(); });
  if (is_last_backward_) {
    for_each_live(tree_, [](FSDPState& s) { s.finish_pending_reductions(); });
  }
  for_each_live(tree_, [](FSDPState& s) { s.in_backward_ = false; });
}

}  // namespace hp::detail
