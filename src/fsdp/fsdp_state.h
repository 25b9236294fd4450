#pragma once
// The runtime of one fully_shard-ed module (or list of modules): what happens before
// and after its forward, before and after its backward, and — for the root, the
// outermost fully_shard-ed module of a forward — at the end of the whole backward.
// Free of torch::nn::Module: it sees tensors and other states only.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "fsdp_param_group.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/policy.h"

namespace hp::detail {

class FSDPState;
using StatePtr = std::shared_ptr<FSDPState>;
using LabeledState = std::pair<std::string, StatePtr>;  // module path, state

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
  bool is_root() const { return root_.lock().get() == this; }
  bool initialized() const { return !root_.expired(); }
  void set_reshard_after_forward(bool value) {
    reshard_after_forward_ = value;
    param_group_->set_post_forward_group(nullptr);
  }
  void set_reshard_after_backward(bool value) { reshard_after_backward_ = value; }
  void set_requires_gradient_sync(bool value) { requires_gradient_sync_ = value; }
  void set_requires_all_reduce(bool value) { requires_all_reduce_ = value; }
  // Only meaningful on the root: it decides whether the end of backward waits for the
  // gradient reductions.
  void set_is_last_backward(bool value);
  // Prefetch without explicit lists: forward in the previous iteration's order,
  // backward in the reverse of this iteration's forward order. Read on the root.
  void set_implicit_prefetch(bool value) { implicit_prefetch_ = value; }
  void set_reduce_op(ReduceOp op);
  void set_gradient_divide_factor(double factor);
  void set_forward_prefetch(std::vector<StatePtr> states);
  void set_backward_prefetch(std::vector<StatePtr> states);
  bool reshard_after_forward() const;
  bool reshard_after_backward() const { return reshard_after_backward_; }
  // Completes reductions left pending (set_is_last_backward(false)).
  void finish_pending_reductions();

 private:
  void begin_forward(const std::vector<at::Tensor*>& inputs);
  void begin_backward();
  void post_backward();
  void end_backward();
  // The root, when a module of its tree offloads: blocks until the device has run the
  // copies to and from host memory, before the host uses that memory.
  void synchronize_if_offloading();
  // Exception safety: a backward that threw (in these hooks or in any other node) leaves
  // no module unsharded, no reduction pending and no flag set for the next one.
  void backward_failed() noexcept;
  // Runs one backward step (a hook's body); if it throws, backward_failed() first.
  template <typename Step>
  void resetting_on_failure(Step&& step) {
    try {
      step();
    } catch (...) {
      backward_failed();
      throw;
    }
  }
  void abandon_backward();  // root only
  void reshard_after_error() noexcept;
  // Activation recomputation reruns forwards inside backward.
  void recompute_pre_forward(const std::vector<at::Tensor*>& inputs);
  void recompute_post_forward(const std::vector<at::Tensor*>& outputs);
  void lazy_init_as_root();
  FSDPState* implicit_forward_prefetch_target();
  FSDPState* implicit_backward_prefetch_target();
  // Unshards this module, prefetching `explicit_list` if set, else `implicit_next`.
  void unshard_then_prefetch(const std::vector<std::weak_ptr<FSDPState>>& explicit_list,
                             FSDPState* implicit_next);
  void root_post_backward_final_callback();
  ReduceSettings reduce_settings() const;

  std::unique_ptr<FSDPParamGroup> param_group_;
  MixedPrecisionPolicy mp_;
  std::optional<bool> reshard_after_forward_;  // unset: not for the root, yes otherwise
  bool reshard_after_backward_ = true;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  bool is_last_backward_ = true;
  bool is_last_backward_set_ = false;
  ReduceOp reduce_op_ = ReduceOp::kAvg;
  std::optional<double> divide_factor_;
  std::function<std::vector<LabeledState>()> subtree_;
  std::string label_ = "module";
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch_;
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch_;

  std::weak_ptr<FSDPState> root_;
  std::vector<std::weak_ptr<FSDPState>> tree_;  // root only: every state it drives
  int forward_depth_ = 0;                       // >1 when several modules share this state
  bool recomputing_ = false;                    // the forward now running is a recompute
  bool in_backward_ = false;                    // pre-backward ran in the current backward
  bool post_backward_done_ = false;
  int post_backward_hooks_pending_ = 0;  // registered in forward, not yet fired
  // Root only: the schedule of the whole tree.
  bool final_callback_queued_ = false;
  bool implicit_prefetch_ = true;
  std::vector<std::weak_ptr<FSDPState>> forward_order_;           // this iteration
  std::vector<std::weak_ptr<FSDPState>> previous_forward_order_;  // the one before
  std::weak_ptr<FSDPState> previous_reducer_;       // whose reduce-scatter is in flight
  std::vector<std::weak_ptr<FSDPState>> reducers_;  // reductions issued in this backward
};

}  // namespace hp::detail
