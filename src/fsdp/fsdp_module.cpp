// FSDPModule: the module interface, forwarding to the state (and, with recurse, to the
// states of the module's subtree).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_state.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/parallel_slice.h"

namespace hp {
namespace {

std::vector<detail::StatePtr> targets(const detail::StatePtr& state, bool recurse) {
  return recurse ? state->subtree() : std::vector<detail::StatePtr>{state};
}

detail::FSDPParam* find_sharded(detail::FSDPState& state, const std::string& name) {
  for (const auto& p : state.param_group().params()) {
    if (p->name() == name) return p.get();
  }
  return nullptr;
}

// The names of the parameters a module manages, for error messages.
std::string known_names(detail::FSDPState& state) {
  std::string names;
  for (const auto& p : state.param_group().params())
    names += (names.empty() ? "" : ", ") + p->name();
  for (const auto& r : state.param_group().replicated())
    names += (names.empty() ? "" : ", ") + r.name;
  return names;
}

// The whole tensor of `value` when `variable` is a parallel slice (its group joins).
at::Tensor whole_of(const at::Tensor& variable, const at::Tensor& value) {
  const auto slice = parallel_slice_of(variable);
  return slice && value.defined() ? join_parallel_slices(value, *slice) : value;
}

}  // namespace

FSDPModule::FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {
  if (!state_) C10_THROW_ERROR(ValueError, "FSDPModule needs a fully_shard state");
}

CommHandle FSDPModule::unshard(bool async_op) {
  // Called outside the hooks, e.g. after an optimizer step: the all-gather lane reads the
  // shards after what compute queued.
  state_->param_group().streams().order_after_compute();
  return state_->param_group().unshard(async_op);
}

void FSDPModule::reshard() { state_->param_group().reshard(); }

bool FSDPModule::is_unsharded() const { return state_->param_group().is_unsharded(); }

void FSDPModule::set_requires_gradient_sync(bool value, bool recurse) {
  for (auto& s : targets(state_, recurse)) s->set_requires_gradient_sync(value);
}

void FSDPModule::set_requires_all_reduce(bool value, bool recurse) {
  for (auto& s : targets(state_, recurse)) s->set_requires_all_reduce(value);
}

void FSDPModule::set_reshard_after_forward(bool value, bool recurse) {
  for (auto& s : targets(state_, recurse)) s->set_reshard_after_forward(value);
}

void FSDPModule::set_reshard_after_backward(bool value, bool recurse) {
  for (auto& s : targets(state_, recurse)) s->set_reshard_after_backward(value);
}

void FSDPModule::set_is_last_backward(bool value) { state_->set_is_last_backward(value); }

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::StatePtr> states;
  for (const auto& m : modules) states.push_back(m.state_);
  state_->set_forward_prefetch(std::move(states));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  std::vector<detail::StatePtr> states;
  for (const auto& m : modules) states.push_back(m.state_);
  state_->set_backward_prefetch(std::move(states));
}

void FSDPModule::set_implicit_prefetch(bool value) { state_->set_implicit_prefetch(value); }

void FSDPModule::set_reduce_op_type(ReduceOp op) {
  for (auto& s : state_->subtree()) s->set_reduce_op(op);
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  for (auto& s : state_->subtree()) s->set_gradient_divide_factor(factor);
}

void FSDPModule::zero_grad() {
  for (auto& s : state_->subtree()) s->param_group().zero_grad();
}

int64_t FSDPModule::error_feedback_blocks_dropped() const {
  int64_t dropped = 0;
  for (auto& s : state_->subtree()) dropped += s->param_group().dropped_residual_blocks();
  return dropped;
}

void FSDPModule::reset_error_feedback() {
  bool any = false;
  for (auto& s : state_->subtree()) {
    if (!s->param_group().error_feedback()) continue;
    s->param_group().reset_error_feedback();
    any = true;
  }
  TORCH_CHECK_VALUE(any,
                    "reset_error_feedback: no fully_shard-ed module under this one has "
                    "CommPolicy::error_feedback");
}

std::vector<ShardedParamInfo> FSDPModule::sharded_params() const {
  std::vector<ShardedParamInfo> infos;
  const std::vector<std::string>& dims = state_->param_group().mesh_info().dims;
  for (const auto& p : state_->param_group().params()) {
    infos.push_back({p->name(), p->layout().global_shape, p->layout().local_shape(),
                     Placement::shard(p->layout().dim), dims});
  }
  for (const auto& r : state_->param_group().replicated()) {
    infos.push_back(
        {r.name, r.variable.sizes().vec(), r.variable.sizes().vec(), Placement::replicate(), dims});
  }
  return infos;
}

at::Tensor FSDPModule::full_tensor(const std::string& name) const {
  c10::NoGradGuard no_grad;
  if (const detail::FSDPParam* p = find_sharded(*state_, name)) {
    return whole_of(p->variable(), detail::gather_whole(*p, {p->padded_shard(), /*owned=*/false},
                                                        *state_->param_group().mesh_info().shard));
  }
  for (const auto& r : state_->param_group().replicated()) {
    if (r.name == name) return whole_of(r.variable, r.data().detach().clone());
  }
  C10_THROW_ERROR(ValueError,
                  "no parameter '" + name +
                      "' in this fully_shard-ed module (it has: " + known_names(*state_) + ")");
}

at::Tensor FSDPModule::full_grad(const std::string& name) const {
  c10::NoGradGuard no_grad;
  if (detail::FSDPParam* p = find_sharded(*state_, name)) {
    at::Tensor grad = p->sharded_grad_or_undefined();
    // Every rank must join the collective; "no gradient" travels as a flag.
    at::Tensor has_grad = at::full({1}, grad.defined() ? 1.0f : 0.0f);
    all_reduce(has_grad, ReduceOp::kMin, *state_->param_group().mesh_info().shard).wait();
    if (has_grad.item<float>() == 0.0f) return {};
    return whole_of(p->variable(), detail::gather_whole(
                                       *p, {p->pad_local(grad, grad.scalar_type()), /*owned=*/true},
                                       *state_->param_group().mesh_info().shard));
  }
  for (const auto& r : state_->param_group().replicated()) {
    if (r.name == name) {
      return r.variable.grad().defined() ? whole_of(r.variable, r.variable.grad().clone())
                                         : at::Tensor();
    }
  }
  C10_THROW_ERROR(ValueError,
                  "no parameter '" + name +
                      "' in this fully_shard-ed module (it has: " + known_names(*state_) + ")");
}

at::Tensor FSDPModule::main_grad(const std::string& name) const {
  if (const detail::FSDPParam* p = find_sharded(*state_, name)) return p->main_grad();
  for (const auto& r : state_->param_group().replicated()) {
    if (r.name == name) return r.fp32_main_grad ? r.variable.grad() : at::Tensor();
  }
  C10_THROW_ERROR(ValueError,
                  "no parameter '" + name +
                      "' in this fully_shard-ed module (it has: " + known_names(*state_) + ")");
}

}  // namespace hp
