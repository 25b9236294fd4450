#include "root_schedule.h"

#include "autograd_hooks.h"
#include "fsdp_state.h"

namespace hp::detail {

void RootSchedule::set_root(const std::shared_ptr<FSDPState>& root, c10::Device device) {
  root_ = root;
  has_had_root_ = true;
  streams_ = std::make_shared<CommStreams>(device);
}

void RootSchedule::set_is_last_backward(bool value) {
  is_last_backward_ = value;
  is_last_backward_set_ = true;
}

void RootSchedule::set_implicit_prefetch(bool value) {
  implicit_prefetch_ = value;
  implicit_prefetch_set_ = true;
}

void RootSchedule::begin_iteration() {
  // A backward that failed (an exception in a hook, ours or the user's) never ran the
  // end-of-backward callback.
  if (end_of_backward_queued_) abandon_backward();
  for_each_state([](FSDPState& s) { s.forget_post_backward_hooks(); });
  // Reductions left pending by a backward with set_is_last_backward(false) finish before
  // parameters are used again.
  bool finished = false;
  for_each_state([&finished](FSDPState& s) {
    finished = finished || s.param_group().reduce_pending();
    s.finish_pending_reductions();
  });
  if (finished) synchronize_if_offloading();
  previous_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
}

void RootSchedule::forward_began(const FSDPState& state) {
  if (forward_first_ != nullptr) return;
  forward_first_ = &state;
  // The shards were last written on the compute stream (the optimizer step): the lanes
  // read them after that, once per forward, and not after later compute.
  streams_->order_after_compute();
}

void RootSchedule::forward_ended(const FSDPState& state) {
  if (forward_first_ == &state) forward_first_ = nullptr;
}

FSDPState* RootSchedule::next_in_forward(const FSDPState& state) const {
  if (!implicit_prefetch_ || !root()) return nullptr;
  const auto& order = previous_forward_order_;
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    if (order[i].lock().get() == &state) return order[i + 1].lock().get();
  }
  return nullptr;
}

FSDPState* RootSchedule::next_in_backward(const FSDPState& state) const {
  auto root_state = root();
  if (!implicit_prefetch_ || !root_state) return nullptr;
  // Backward runs modules in reverse forward order, known from this iteration's forward
  // already. The root's backward starts first; the last module of the forward follows it.
  const auto& order = forward_order_;
  if (&state == root_state.get()) return order.empty() ? nullptr : order.back().lock().get();
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i].lock().get() == &state) return order[i - 1].lock().get();
  }
  return nullptr;
}

void RootSchedule::queue_end_of_backward() {
  if (end_of_backward_queued_) return;
  end_of_backward_queued_ = true;
  std::weak_ptr<RootSchedule> weak_schedule = weak_from_this();
  queue_end_of_backward_callback([weak_schedule] {
    auto schedule = weak_schedule.lock();
    if (!schedule) return;
    try {
      schedule->end_backward();
    } catch (...) {
      schedule->abandon_backward();
      throw;
    }
  });
}

void RootSchedule::reduction_issued(const std::shared_ptr<FSDPState>& state) {
  reduction_in_flight_ = state;
  reductions_.push_back(state);
}

void RootSchedule::end_backward() {
  end_of_backward_queued_ = false;
  for_each_state([](FSDPState& s) { s.post_backward(); });
  if (auto last = reduction_in_flight_.lock()) last->param_group().start_all_reduce();
  reduction_in_flight_.reset();
  if (is_last_backward_) {
    for (const auto& weak : reductions_) {
      if (auto state = weak.lock()) state->finish_pending_reductions();
    }
  }
  reductions_.clear();
  for_each_state([](FSDPState& s) { s.end_backward(); });
  streams_->free_held_memory();
  synchronize_if_offloading();
}

void RootSchedule::abandon_backward() noexcept {
  end_of_backward_queued_ = false;
  reduction_in_flight_.reset();
  reductions_.clear();
  for_each_state([](FSDPState& s) { s.abandon_backward(); });
}

void RootSchedule::synchronize_if_offloading() {
  bool offloads = false;
  for_each_state([&offloads](FSDPState& s) { offloads = offloads || s.param_group().offloads(); });
  // Offloaded shards and gradients are host memory the optimizer steps on next: the
  // asynchronous copies to and from the device are waited once, here.
  if (offloads) streams_->synchronize();
}

}  // namespace hp::detail
