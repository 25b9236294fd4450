#pragma once
// The schedule of one fully_shard-ed tree: what spans its modules, owned by the root (the
// outermost fully_shard-ed module of a forward) and shared by every state the root drives
// (FSDP2's FSDPStateContext). It holds the states of the tree, the order their forwards
// ran in (this iteration and the one before, for implicit prefetch), the gradient
// reductions issued in the current backward, the communication streams, the
// end-of-backward callback and the settings made on the root. FSDPState runs one module's
// hooks and asks the schedule for everything about the other modules.
//
// Until a root adopts it, every state has a schedule of its own that only records the
// settings made on it (set_is_last_backward, set_implicit_prefetch), so that a setting
// made on a module that turns out not to be the root is found and named.

#include <memory>
#include <vector>

#include "comm_streams.h"

namespace hp::detail {

class FSDPState;

class RootSchedule : public std::enable_shared_from_this<RootSchedule> {
 public:
  // --- the tree --------------------------------------------------------------------
  // Makes `root` the root of this schedule; streams for its device are made here.
  void set_root(const std::shared_ptr<FSDPState>& root, c10::Device device);
  void adopt(const std::shared_ptr<FSDPState>& state) { states_.push_back(state); }
  // Whether a root has driven this schedule (even one since dropped).
  bool has_had_root() const { return has_had_root_; }
  // The live root, or null.
  std::shared_ptr<FSDPState> root() const { return root_.lock(); }
  const std::shared_ptr<CommStreams>& streams() const { return streams_; }
  template <typename Visit>
  void for_each_state(Visit visit) const {
    for (const auto& weak : states_) {
      if (auto state = weak.lock()) visit(*state);
    }
  }

  // --- settings made on the root ---------------------------------------------------
  void set_is_last_backward(bool value);
  bool is_last_backward_set() const { return is_last_backward_set_; }
  void set_implicit_prefetch(bool value);
  bool implicit_prefetch_set() const { return implicit_prefetch_set_; }

  // --- forward ---------------------------------------------------------------------
  // At the root's pre-forward: recovers from a backward that never ended, finishes the
  // reductions a backward with set_is_last_backward(false) left pending, and starts a
  // new forward order.
  void begin_iteration();
  // At every state's pre-forward and at its end (or failure). The first state of a
  // forward (the root, or a module of the tree run on its own: one block probed, a
  // sub-module generating) is that forward's first (FSDP2's iteration forward root): the
  // lanes are ordered after the compute queued so far, the optimizer's update of the
  // shards, before the first all-gather reads them.
  void forward_began(const FSDPState& state);
  void forward_ended(const FSDPState& state);
  void record_forward(const std::shared_ptr<FSDPState>& state) { forward_order_.push_back(state); }
  // Implicit prefetch: the module that ran after `state` in the previous forward; and in
  // backward, the one that ran before it in this forward (the last one for the root).
  // Null without one, or with implicit prefetch off.
  FSDPState* next_in_forward(const FSDPState& state) const;
  FSDPState* next_in_backward(const FSDPState& state) const;

  // --- backward --------------------------------------------------------------------
  // Queues end_backward() with autograd, once per backward.
  void queue_end_of_backward();
  // The state whose reduce-scatter is in flight (the previous step of the backward
  // pipeline), or null; and recording `state` as the next one.
  std::shared_ptr<FSDPState> reduction_in_flight() const { return reduction_in_flight_.lock(); }
  void reduction_issued(const std::shared_ptr<FSDPState>& state);
  // Exception safety: after a backward that threw (in a hook or in any other node) no
  // module stays unsharded, no reduction pending and no flag set for the next one.
  void abandon_backward() noexcept;

 private:
  // The end of the whole backward: the post-backward of modules whose hook never fired,
  // the last all-reduce, and (unless set_is_last_backward(false)) every pending
  // reduction waited once, in issue order.
  void end_backward();
  // When a module of the tree offloads: blocks until the device has run the copies to
  // and from host memory, before the host uses that memory.
  void synchronize_if_offloading();

  std::weak_ptr<FSDPState> root_;
  bool has_had_root_ = false;
  std::vector<std::weak_ptr<FSDPState>> states_;
  std::shared_ptr<CommStreams> streams_;
  bool is_last_backward_ = true;
  bool is_last_backward_set_ = false;
  bool implicit_prefetch_ = true;
  bool implicit_prefetch_set_ = false;
  std::vector<std::weak_ptr<FSDPState>> forward_order_;           // this iteration
  std::vector<std::weak_ptr<FSDPState>> previous_forward_order_;  // the one before
  const FSDPState* forward_first_ = nullptr;  // the state whose forward runs outermost
  bool end_of_backward_queued_ = false;
  std::weak_ptr<FSDPState> reduction_in_flight_;
  std::vector<std::weak_ptr<FSDPState>> reductions_;  // issued in this backward
};

}  // namespace hp::detail
