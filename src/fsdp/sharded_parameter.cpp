// ShardedParameter: the public view of an FSDPParam, for the training features built on
// fully_shard (materialize, checkpoints, clip_grad), which see only this.
#include "hyperparallel/sharded_parameter.h"

#include "fsdp_param.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"
#include "state_registry.h"

namespace hp {

ShardedParameter::ShardedParameter(std::shared_ptr<detail::FSDPState> state,
                                   detail::FSDPParam* param)
    : state_(std::move(state)), param_(param) {}

const at::Tensor& ShardedParameter::local() const { return param_->sharded_view(); }

at::Tensor ShardedParameter::local_grad() const { return param_->sharded_grad_or_undefined(); }

const std::vector<int64_t>& ShardedParameter::global_shape() const {
  return param_->layout().global_shape;
}

int64_t ShardedParameter::shard_dim() const { return param_->layout().dim; }

int64_t ShardedParameter::shard_offset() const { return param_->layout().start(); }

const Group& ShardedParameter::shard_group() const {
  return *state_->param_group().mesh_info().shard;
}

const Group& ShardedParameter::replicate_group() const {
  return *state_->param_group().mesh_info().replicate;
}

const Group& ShardedParameter::data_parallel_group() const {
  return *state_->param_group().mesh_info().data_parallel;
}

const std::shared_ptr<World>& ShardedParameter::world() const {
  return state_->param_group().mesh_info().world;
}

bool ShardedParameter::is_unsharded() const { return param_->is_unsharded(); }

at::Tensor ShardedParameter::full() const {
  return detail::gather_whole(*param_, {param_->padded_shard(), /*owned=*/false}, shard_group());
}

at::Tensor ShardedParameter::full(const at::Tensor& local_like) const {
  return detail::gather_whole(
      *param_, {param_->pad_local(local_like, local_like.scalar_type()), /*owned=*/true},
      shard_group());
}

namespace {

// An offloaded shard may still be read by an asynchronous copy to the GPU (a forward's
// all-gather input): the host writes it only once the copies ran.
void before_host_write(detail::FSDPState& state, const detail::FSDPParam& param) {
  if (param.offloads()) state.param_group().streams().synchronize();
}

}  // namespace

void ShardedParameter::set_full(const at::Tensor& whole) const {
  before_host_write(*state_, *param_);
  param_->load_full(whole);
}

void ShardedParameter::set_local(const at::Tensor& local) const {
  before_host_write(*state_, *param_);
  param_->load_local(local);
}

at::Tensor ShardedParameter::error_feedback_residual() const { return param_->residual(); }

std::vector<int64_t> ShardedParameter::error_feedback_residual_shape() const {
  return state_->param_group().error_feedback() ? param_->residual_shape() : std::vector<int64_t>();
}

void ShardedParameter::set_error_feedback_residual(const at::Tensor& residual) const {
  state_->param_group().set_residual(*param_, residual);
}

std::optional<ShardedParameter> sharded_parameter_of(const at::Tensor& variable) {
  auto [state, param] = detail::find_fsdp_param(variable);
  if (!state) return std::nullopt;
  return ShardedParameter(std::move(state), param);
}

}  // namespace hp
