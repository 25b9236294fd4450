#include "fsdp_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include "../recompute/recompute_scope.h"
#include "../trace/trace_recording.h"
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

// A forward that runs while autograd executes a backward is activation recomputation
// recomputing it.
bool inside_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

// Whether backward will run through the graph the current forward builds: not in
// no-grad mode, and not for a recompute that only recovers saved tensors.
bool graph_will_be_backpropagated() {
  return c10::GradMode::is_enabled() && !SavedTensorRecomputeScope::active();
}

}  // namespace

FSDPState::FSDPState(std::unique_ptr<FSDPParamGroup> param_group, MixedPrecisionPolicy mp,
                     std::optional<bool> reshard_after_forward,
                     std::function<std::vector<LabeledState>()> subtree)
    : param_group_(std::move(param_group)),
      mp_(mp),
      reshard_after_forward_(reshard_after_forward),
      subtree_(std::move(subtree)) {}

bool FSDPState::reshard_after_forward() const {
  return reshard_after_forward_.value_or(!is_root());
}

void FSDPState::set_reduce_op(ReduceOp op) {
  TORCH_CHECK_VALUE(op == ReduceOp::kSum || op == ReduceOp::kAvg,
                    "gradients are reduced with ReduceOp::kSum or ReduceOp::kAvg, not \"",
                    to_string(op), "\"");
  reduce_op_ = op;
}

void FSDPState::set_gradient_divide_factor(double factor) {
  TORCH_CHECK_VALUE(factor > 0, "gradient divide factor must be positive, got ",
                    std::to_string(factor));
  divide_factor_ = factor;
}

void FSDPState::set_is_last_backward(bool value) {
  TORCH_CHECK(!initialized() || is_root(),
              "set_is_last_backward applies to the root (the outermost "
              "fully_shard-ed module of the forward); call it there");
  schedule_->set_is_last_backward(value);
}

void FSDPState::set_implicit_prefetch(bool value) {
  TORCH_CHECK(!initialized() || is_root(),
              "set_implicit_prefetch applies to the root (the outermost "
              "fully_shard-ed module of the forward); call it there");
  schedule_->set_implicit_prefetch(value);
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
  const auto& mesh_info = param_group_->mesh_info();
  const double data_parallel =
      static_cast<double>(mesh_info.shard->size() * mesh_info.replicate->size());
  settings.divide_factor =
      divide_factor_.value_or(reduce_op_ == ReduceOp::kAvg ? data_parallel : 1.0);
  return settings;
}

std::vector<StatePtr> FSDPState::subtree() const {
  std::vector<StatePtr> states;
  for (auto& [label, state] : subtree_()) states.push_back(state);
  return states;
}

void FSDPState::lazy_init_as_root() {
  // A schedule left by a root since dropped starts afresh; this state's own keeps the
  // settings made on it.
  if (schedule_->has_had_root()) schedule_ = std::make_shared<RootSchedule>();
  std::vector<LabeledState> driven;
  for (const auto& [label, state] : subtree_()) {
    // A state already driven by another root keeps it (it is used standalone).
    if (state.get() != this && state->initialized() && !state->is_root()) continue;
    if (state.get() != this) state->check_no_root_settings();
    driven.emplace_back(label, state);
  }
  // One set of communication streams for every module this root drives.
  schedule_->set_root(shared_from_this(), param_group_->mesh_info().device);
  for (auto& [label, state] : driven)
    state->join_schedule(schedule_, state.get() == this ? "root" : label);
}

void FSDPState::check_no_root_settings() const {
  // Settings made on a module (its own schedule, or the one of the tree it was the root
  // of) that turns out not to be the root would be lost.
  if (schedule_->has_had_root() && !is_root()) return;
  TORCH_CHECK(!schedule_->is_last_backward_set(),
              "set_is_last_backward was called on a module that turned out not "
              "to be the root; call it on the root module");
  TORCH_CHECK(!schedule_->implicit_prefetch_set(),
              "set_implicit_prefetch was called on a module that turned out not "
              "to be the root; call it on the root module");
}

void FSDPState::join_schedule(const std::shared_ptr<RootSchedule>& schedule, std::string label) {
  schedule_ = schedule;
  param_group_->set_streams(schedule_->streams());
  label_ = std::move(label);
  param_group_->set_label(label_);
  schedule_->adopt(shared_from_this());
}

void FSDPState::finish_pending_reductions() { param_group_->finish_reduce(); }

void FSDPState::unshard_then_prefetch(const std::vector<std::weak_ptr<FSDPState>>& explicit_list,
                                      FSDPState* implicit_next) {
  // This module's all-gather (unless a prefetch issued it already) and the prefetch are
  // both issued before waiting: the prefetch then starts as soon as the first one is
  // done, not after this thread has woken up and come back here.
  param_group_->unshard(/*async=*/true);
  if (!explicit_list.empty()) {
    for (const auto& weak : explicit_list) {
      if (auto state = weak.lock()) state->param_group_->unshard(/*async=*/true);
    }
  } else if (implicit_next) {
    implicit_next->param_group_->unshard(/*async=*/true);
  }
  param_group_->wait_for_unshard();
}

void FSDPState::pre_forward(const std::vector<at::Tensor*>& inputs) {
  if (!initialized()) lazy_init_as_root();
  if (forward_depth_++ > 0) return;  // another module of this state is mid-forward
  try {
    if (inside_backward()) return recompute_pre_forward(inputs);
    begin_forward(inputs);
  } catch (...) {  // e.g. the all-gather ran out of memory: the next forward starts afresh
    forward_failed();
    throw;
  }
}

void FSDPState::begin_forward(const std::vector<at::Tensor*>& inputs) {
  if (is_root()) schedule_->begin_iteration();
  schedule_->forward_began(*this);
  training_state_ = TrainingState::kForward;
  schedule_->record_forward(shared_from_this());
  trace::record(trace::Kind::kBegin, "forward", label_);
  // Forward prefetch: the next module's all-gather runs while this one computes.
  unshard_then_prefetch(forward_prefetch_, schedule_->next_in_forward(*this));
  if (mp_.cast_forward_inputs && mp_.param_dtype) cast_floating(inputs, *mp_.param_dtype);
  if (c10::GradMode::is_enabled()) {
    if (register_post_backward_hook(inputs, weak_from_this())) {
      ++post_backward_hooks_pending_;
    } else {
      forward_without_hook_ = true;
    }
  }
}

void FSDPState::forward_failed() {
  if (--forward_depth_ > 0) return;
  if (training_state_ == TrainingState::kForward) training_state_ = TrainingState::kIdle;
  schedule_->forward_ended(*this);
  if (inside_backward()) {
    // A recompute left early: stopped once it had recovered what backward needs (the
    // parameters stay gathered for that backward), or failed, failing its backward,
    // which the next forward recovers. This runs while the exception unwinds.
    try {
      trace::record(trace::Kind::kEnd, "recompute", label_);
    } catch (...) {  // a lost trace mark is secondary to the exception
    }
    return;
  }
  // Nothing gathered for this forward (this module, prefetched ones, for the root the
  // whole tree) stays allocated or pending after the error.
  if (is_root()) {
    schedule_->for_each_state([](FSDPState& s) { s.reshard_after_error(); });
  } else {
    reshard_after_error();
  }
}

void FSDPState::reshard_after_error() noexcept {
  try {
    param_group_->reshard();
  } catch (...) {  // secondary to the error being handled
  }
}

void FSDPState::abandon_backward() noexcept {
  training_state_ = TrainingState::kIdle;
  post_backward_hooks_pending_ = 0;
  forward_without_hook_ = false;
  try {
    param_group_->discard_reduce();
  } catch (...) {  // secondary to the error being handled
  }
  reshard_after_error();
}

void FSDPState::post_forward(const std::vector<at::Tensor*>& outputs) {
  if (--forward_depth_ > 0) return;
  if (training_state_ != TrainingState::kForward) return recompute_post_forward(outputs);
  training_state_ = TrainingState::kIdle;
  schedule_->forward_ended(*this);
  if (!c10::GradMode::is_enabled()) {
    // No backward follows (evaluation): keeping parameters gathered would only let an
    // optimizer step in between act on stale copies.
    param_group_->reshard();
  } else if (param_group_->has_post_forward_group()) {
    param_group_->reshard_to_post_forward_group();
  } else if (reshard_after_forward()) {
    param_group_->reshard();
  }
  if (mp_.output_dtype) cast_floating(outputs, *mp_.output_dtype);
  if (c10::GradMode::is_enabled()) register_pre_backward_hooks(outputs, weak_from_this());
  trace::record(trace::Kind::kEnd, "forward", label_);
}

void FSDPState::recompute_pre_forward(const std::vector<at::Tensor*>& inputs) {
  // The iteration's forward order and the prefetches are left alone: this is not a new
  // forward. The parameters stay gathered afterwards, for the backward that follows.
  trace::record(trace::Kind::kBegin, "recompute", label_);
  param_group_->unshard(/*async=*/true);
  param_group_->wait_for_unshard();
  if (mp_.cast_forward_inputs && mp_.param_dtype) cast_floating(inputs, *mp_.param_dtype);
  // A reentrant recompute backpropagates through the recompute (a nested backward):
  // this module's gradients are reduced from there.
  if (graph_will_be_backpropagated() && register_post_backward_hook(inputs, weak_from_this())) {
    ++post_backward_hooks_pending_;
  }
}

void FSDPState::recompute_post_forward(const std::vector<at::Tensor*>& outputs) {
  if (mp_.output_dtype) cast_floating(outputs, *mp_.output_dtype);
  if (graph_will_be_backpropagated()) register_pre_backward_hooks(outputs, weak_from_this());
  trace::record(trace::Kind::kEnd, "recompute", label_);
}

void FSDPState::pre_backward() {
  if (training_state_ == TrainingState::kPreBackward ||
      training_state_ == TrainingState::kPostBackward) {
    return;
  }
  abandoning_backward_on_failure([this] { begin_backward(); });
}

void FSDPState::begin_backward() {
  training_state_ = TrainingState::kPreBackward;
  schedule_->queue_end_of_backward();
  trace::record(trace::Kind::kBegin, "backward", label_);
  param_group_->stash_replicated_grads();
  // Backward prefetch: the next module (in backward order) gathers during this
  // module's backward.
  unshard_then_prefetch(backward_prefetch_, schedule_->next_in_backward(*this));
}

void FSDPState::post_backward_hook_fired() {
  // A module of this state whose inputs needed no gradient has no hook to say when its
  // backward is done: the end of the whole backward reduces.
  if (--post_backward_hooks_pending_ > 0 || forward_without_hook_) return;
  abandoning_backward_on_failure([this] { post_backward(); });
}

void FSDPState::post_backward() {
  post_backward_hooks_pending_ = 0;
  forward_without_hook_ = false;
  if (training_state_ != TrainingState::kPreBackward) return;
  training_state_ = TrainingState::kPostBackward;
  trace::record(trace::Kind::kEnd, "backward", label_);
  param_group_->finish_reduce();  // one left pending by set_is_last_backward(false)
  std::shared_ptr<FSDPState> previous = schedule_->reduction_in_flight();
  // The 4-step pipeline: reduce-scatter (shard dim) of this module and all-reduce
  // (replicate dim) of the previous one are in flight with the next module's backward
  // and its all-gather.
  if (previous) previous->param_group_->wait_reduce_scatter();  // 1 + 2 (pure FSDP: installed)
  param_group_->start_reduce(reduce_settings());                // 3
  if (previous) previous->param_group_->start_all_reduce();     // 4
  if (param_group_->reduce_pending()) schedule_->reduction_issued(shared_from_this());
  if (reshard_after_backward_) param_group_->reshard();
}

void FSDPState::end_backward() {
  training_state_ = TrainingState::kIdle;
  if (reshard_after_backward_) param_group_->reshard();
}

}  // namespace hp::detail
