#pragma once
// The runtime of one fully_shard-ed module (or list of modules): what happens before
// and after its forward and before and after its backward. What spans modules (the
// tree, the forward order, the reductions in flight, the end of the whole backward) is
// the RootSchedule the state shares with the rest of its tree.
// Free of torch::nn::Module: it sees tensors and other states only.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "fsdp_param_group.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/policy.h"
#include "root_schedule.h"

namespace hp::detail {

class FSDPState;
using StatePtr = std::shared_ptr<FSDPState>;
using LabeledState = std::pair<std::string, StatePtr>;  // module path, state

// Where a module is in the training step. A recompute (a forward rerun inside backward)
// leaves it unchanged.
enum class TrainingState {
  kIdle,
  kForward,       // its forward runs
  kPreBackward,   // its backward started: parameters gathered for its gradients
  kPostBackward,  // its gradients are reduced; until the end of the whole backward
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // `subtree` lists the states of this module's subtree (this one first), in module
  // order; it is asked when this state becomes a root.
  FSDPState(std::unique_ptr<FSDPParamGroup> param_group, MixedPrecisionPolicy mp,
            std::optional<bool> reshard_after_forward,
            std::function<std::vector<LabeledState>()> subtree);

  FSDPParamGroup& param_group() { return *param_group_; }
  const MixedPrecisionPolicy& mp_policy() const { return mp_; }

  // --- hooks (called by the module adapter and by autograd) ---------------------
  // A pre-forward that throws undoes itself (as forward_failed) before rethrowing.
  void pre_forward(const std::vector<at::Tensor*>& inputs);
  void post_forward(const std::vector<at::Tensor*>& outputs);
  // Instead of post_forward when the module's forward threw: reshards what this forward
  // gathered (for the root: every module of the tree) so the next forward starts clean.
  void forward_failed();
  void pre_backward();
  // From the identity function over one module's inputs. A state shared by several
  // modules reduces only after the last of them finished its backward.
  void post_backward_hook_fired();

  // --- the module interface -----------------------------------------------------
  std::vector<StatePtr> subtree() const;
  // The module path below the root ("root" for the root), for traces.
  const std::string& label() const { return label_; }
  bool is_root() const { return schedule_->root().get() == this; }
  bool initialized() const { return schedule_->root() != nullptr; }
  void set_reshard_after_forward(bool value) {
    reshard_after_forward_ = value;
    param_group_->set_post_forward_group(nullptr);
  }
  void set_reshard_after_backward(bool value) { reshard_after_backward_ = value; }
  void set_requires_gradient_sync(bool value) { requires_gradient_sync_ = value; }
  void set_requires_all_reduce(bool value) { requires_all_reduce_ = value; }
  // Settings of the whole tree, made on the root (an error on any other module): whether
  // the end of backward waits for the gradient reductions, and prefetch without explicit
  // lists (forward in the previous iteration's order, backward in the reverse of this
  // iteration's forward order).
  void set_is_last_backward(bool value);
  void set_implicit_prefetch(bool value);
  void set_reduce_op(ReduceOp op);
  void set_gradient_divide_factor(double factor);
  void set_forward_prefetch(std::vector<StatePtr> states);
  void set_backward_prefetch(std::vector<StatePtr> states);
  bool reshard_after_forward() const;
  bool reshard_after_backward() const { return reshard_after_backward_; }
  // Completes reductions left pending (set_is_last_backward(false)).
  void finish_pending_reductions();

  // --- what the schedule runs on each state of its tree ----------------------------
  // A new iteration: hooks registered by a forward whose backward never ran are dropped.
  void forget_post_backward_hooks() {
    post_backward_hooks_pending_ = 0;
    forward_without_hook_ = false;
  }
  // At the end of backward, for a module whose post-backward hook never fired (its
  // inputs needed no gradient: the root, typically).
  void post_backward();
  // The whole backward is over; a module prefetched but not run (control flow changed)
  // must not stay gathered.
  void end_backward();
  // The backward failed: its reductions hold partial gradients and are dropped, never
  // installed (after a zero_grad they would otherwise reappear in the next step).
  void abandon_backward() noexcept;
  // Reshards, ignoring a failure (secondary to the error being handled).
  void reshard_after_error() noexcept;

 private:
  void begin_forward(const std::vector<at::Tensor*>& inputs);
  void begin_backward();
  // Runs one backward step (a hook's body); if it throws, the schedule abandons the
  // backward first.
  template <typename Step>
  void abandoning_backward_on_failure(Step&& step) {
    try {
      step();
    } catch (...) {
      schedule_->abandon_backward();
      throw;
    }
  }
  // Activation recomputation reruns forwards inside backward.
  void recompute_pre_forward(const std::vector<at::Tensor*>& inputs);
  void recompute_post_forward(const std::vector<at::Tensor*>& outputs);
  void lazy_init_as_root();
  // Throws if a root-only setting was made on this state while it was its own root.
  void check_no_root_settings() const;
  // Joins `schedule` (its root's) under `label`: its streams, its reductions.
  void join_schedule(const std::shared_ptr<RootSchedule>& schedule, std::string label);
  // Unshards this module, prefetching `explicit_list` if set, else `implicit_next`.
  void unshard_then_prefetch(const std::vector<std::weak_ptr<FSDPState>>& explicit_list,
                             FSDPState* implicit_next);
  ReduceSettings reduce_settings() const;

  std::unique_ptr<FSDPParamGroup> param_group_;
  MixedPrecisionPolicy mp_;
  std::optional<bool> reshard_after_forward_;  // unset: not for the root, yes otherwise
  bool reshard_after_backward_ = true;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  ReduceOp reduce_op_ = ReduceOp::kAvg;
  std::optional<double> divide_factor_;
  std::function<std::vector<LabeledState>()> subtree_;
  std::string label_ = "module";
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch_;
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch_;

  std::shared_ptr<RootSchedule> schedule_ = std::make_shared<RootSchedule>();
  TrainingState training_state_ = TrainingState::kIdle;
  int forward_depth_ = 0;                // >1 when several modules share this state
  int post_backward_hooks_pending_ = 0;  // registered in forward, not yet fired
  bool forward_without_hook_ = false;    // a forward whose inputs needed no gradient
};

}  // namespace hp::detail
