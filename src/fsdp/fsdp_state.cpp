#include "fsdp_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <stdexcept>

#include "autograd_hooks.h"
#include "hyperparallel/trace.h"
#include "../recompute/recompute_scope.h"

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
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw std::invalid_argument(
        "gradients are reduced with ReduceOp::kSum or ReduceOp::kAvg, not \"" + to_string(op) +
        "\"");
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
  std::vector<LabeledState> driven;
  for (const auto& [label, state] : subtree_()) {
    // A state already driven by another root keeps it (it is used standalone).
    if (state.get() != this && state->initialized() && !state->is_root()) continue;
    if (state.get() != this && state->is_last_backward_set_) {
      throw std::logic_error(
          "set_is_last_backward was called on a module that turned out not "
          "to be the root; call it on the root module");
    }
    driven.emplace_back(label, state);
  }
  // One set of communication streams for every module this root drives.
  auto streams = std::make_shared<CommStreams>(param_group_->mesh_info().world->device());
  for (auto& [label, state] : driven) {
    state->param_group_->set_streams(streams);
    state->root_ = weak_from_this();
    state->label_ = state.get() == this ? "root" : label;
    state->param_group_->set_label(state->label_);
    tree_.push_back(state);
  }
}

void FSDPState::finish_pending_reductions() { param_group_->finish_reduce(); }

FSDPState* FSDPState::implicit_forward_prefetch_target() {
  auto root = root_.lock();
  if (!root || !root->implicit_prefetch_) return nullptr;
  // The module that ran after this one in the previous forward.
  const auto& order = root->previous_forward_order_;
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    if (order[i].lock().get() == this) return order[i + 1].lock().get();
  }
  return nullptr;
}

FSDPState* FSDPState::implicit_backward_prefetch_target() {
  auto root = root_.lock();
  if (!root || !root->implicit_prefetch_) return nullptr;
  // Backward runs modules in reverse forward order: the one before this in forward
  // is the next in backward (known from this iteration's forward already). The root's
  // backward starts first; the last module of the forward follows it.
  const auto& order = root->forward_order_;
  if (this == root.get()) return order.empty() ? nullptr : order.back().lock().get();
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i].lock().get() == this) return order[i - 1].lock().get();
  }
  return nullptr;
}

void FSDPState::unshard_then_prefetch(const std::vector<std::weak_ptr<FSDPState>>& explicit_list,
                                      FSDPState* implicit_next) {
  // This module's all-gather (unless a prefetch issued it already) and the prefetch are
  // both issued before waiting: the prefetch then starts as soon as the first one is
  // done, not after this thread has woken up and come back here.
  param_group_->unshard(/*async=*/true);
  if (!explicit_list.empty()) {
    for_each_live(explicit_list, [](FSDPState& s) { s.param_group_->unshard(/*async=*/true); });
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
  auto root = root_.lock();
  if (root.get() == this) {
    // A backward that failed (an exception in a hook, its own or the user's) never ran
    // the end-of-backward callback.
    if (final_callback_queued_) abandon_backward();
    for_each_live(tree_, [](FSDPState& s) { s.post_backward_hooks_pending_ = 0; });
    // Reductions left pending by a backward with set_is_last_backward(false) finish
    // before parameters are used again.
    bool finished = false;
    for_each_live(tree_, [&finished](FSDPState& s) {
      finished = finished || s.param_group_->reduce_pending();
      s.finish_pending_reductions();
    });
    if (finished) synchronize_if_offloading();
    previous_forward_order_ = std::move(forward_order_);
    forward_order_.clear();
    // The shards were last written on the compute stream (the optimizer step): the lanes
    // read them after that, once per forward, and not after later compute.
    param_group_->streams().order_after_compute();
  }
  if (root) root->forward_order_.push_back(weak_from_this());
  trace::record(trace::Kind::kBegin, "forward", label_);
  // Forward prefetch: the next module's all-gather runs while this one computes.
  unshard_then_prefetch(forward_prefetch_, implicit_forward_prefetch_target());
  if (mp_.cast_forward_inputs && mp_.param_dtype) cast_floating(inputs, *mp_.param_dtype);
  if (c10::GradMode::is_enabled() && register_post_backward_hook(inputs, weak_from_this())) {
    ++post_backward_hooks_pending_;
  }
}

void FSDPState::forward_failed() {
  if (--forward_depth_ > 0) return;
  recomputing_ = false;
  // A failed recompute fails its backward, which the next forward recovers.
  if (inside_backward()) return;
  // Nothing gathered for this forward (this module, prefetched ones, for the root the
  // whole tree) stays allocated or pending after the error.
  auto root = root_.lock();
  if (root.get() == this) {
    for_each_live(tree_, [](FSDPState& s) { s.reshard_after_error(); });
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

void FSDPState::abandon_backward() {
  final_callback_queued_ = false;
  previous_reducer_.reset();
  reducers_.clear();
  for_each_live(tree_, [](FSDPState& s) {
    s.in_backward_ = false;
    s.post_backward_hooks_pending_ = 0;
    // Reductions of the failed backward hold partial gradients: dropped, never installed
    // (after a zero_grad they would otherwise reappear in the next step).
    s.param_group_->discard_reduce();
    s.reshard_after_error();
  });
}

void FSDPState::backward_failed() noexcept {
  // The engine drops the end-of-backward callback of a failed backward: clean up now, so
  // that an optimizer step after the error sees sharded parameters.
  if (auto root = root_.lock()) {
    try {
      root->abandon_backward();
    } catch (...) {  // secondary; the next forward retries
    }
  }
}

void FSDPState::post_forward(const std::vector<at::Tensor*>& outputs) {
  if (--forward_depth_ > 0) return;
  if (recomputing_) return recompute_post_forward(outputs);
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
  recomputing_ = true;
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
  recomputing_ = false;
  if (mp_.output_dtype) cast_floating(outputs, *mp_.output_dtype);
  if (graph_will_be_backpropagated()) register_pre_backward_hooks(outputs, weak_from_this());
  trace::record(trace::Kind::kEnd, "recompute", label_);
}

void FSDPState::pre_backward() {
  if (in_backward_) return;
  resetting_on_failure([this] { begin_backward(); });
}

void FSDPState::begin_backward() {
  in_backward_ = true;
  post_backward_done_ = false;
  if (auto root = root_.lock(); root && !root->final_callback_queued_) {
    root->final_callback_queued_ = true;
    std::weak_ptr<FSDPState> weak_root = root;
    queue_end_of_backward_callback([weak_root] {
      if (auto r = weak_root.lock()) r->root_post_backward_final_callback();
    });
  }
  trace::record(trace::Kind::kBegin, "backward", label_);
  param_group_->stash_replicated_grads();
  // Backward prefetch: the next module (in backward order) gathers during this
  // module's backward.
  unshard_then_prefetch(backward_prefetch_, implicit_backward_prefetch_target());
}

void FSDPState::post_backward_hook_fired() {
  if (--post_backward_hooks_pending_ > 0) return;
  resetting_on_failure([this] { post_backward(); });
}

void FSDPState::post_backward() {
  post_backward_hooks_pending_ = 0;
  if (!in_backward_ || post_backward_done_) return;
  post_backward_done_ = true;
  trace::record(trace::Kind::kEnd, "backward", label_);
  param_group_->finish_reduce();  // one left pending by set_is_last_backward(false)
  auto root = root_.lock();
  std::shared_ptr<FSDPState> previous = root ? root->previous_reducer_.lock() : nullptr;
  // The 4-step pipeline: reduce-scatter (shard dim) of this module and all-reduce
  // (replicate dim) of the previous one are in flight with the next module's backward
  // and its all-gather.
  if (previous) previous->param_group_->wait_reduce_scatter();  // 1 + 2 (pure FSDP: installed)
  param_group_->start_reduce(reduce_settings());                // 3
  if (previous) previous->param_group_->start_all_reduce();     // 4
  if (root && param_group_->reduce_pending()) {
    root->previous_reducer_ = weak_from_this();
    root->reducers_.push_back(weak_from_this());
  }
  if (reshard_after_backward_) param_group_->reshard();
}

void FSDPState::root_post_backward_final_callback() {
  resetting_on_failure([this] { end_backward(); });
}

void FSDPState::end_backward() {
  final_callback_queued_ = false;
  // States whose inputs needed no gradient (the root itself, typically) never saw
  // their post-backward hook fire: run it now.
  for_each_live(tree_, [](FSDPState& s) { s.post_backward(); });
  if (auto last = previous_reducer_.lock()) last->param_group_->start_all_reduce();
  previous_reducer_.reset();
  if (is_last_backward_) {
    // All outstanding all-reduces are waited once, here, in the order they were issued.
    for_each_live(reducers_, [](FSDPState& s) { s.finish_pending_reductions(); });
  }
  reducers_.clear();
  for_each_live(tree_, [](FSDPState& s) {
    s.in_backward_ = false;
    // A module prefetched but not run (control flow changed) must not stay gathered.
    if (s.reshard_after_backward_) s.param_group_->reshard();
  });
  synchronize_if_offloading();
}

void FSDPState::synchronize_if_offloading() {
  bool offloads = false;
  for_each_live(tree_,
                [&offloads](FSDPState& s) { offloads = offloads || s.param_group_->offloads(); });
  // Offloaded shards and gradients are host memory the optimizer steps on next: the
  // asynchronous copies to and from the device are waited once, here.
  if (offloads) param_group_->streams().synchronize();
}

}  // namespace hp::detail
