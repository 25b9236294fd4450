#include "fsdp_param.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <stdexcept>

#include "../runtime/deferred_init_engine.h"
#include "hyperparallel/collectives.h"

namespace hp::detail {

ShardLayout::ShardLayout(std::vector<int64_t> shape, int64_t shard_dim, int64_t world_size,
                         int64_t rank_in_group)
    : global_shape(std::move(shape)), dim(shard_dim), world(world_size), rank(rank_in_group) {
  const int64_t size = global_shape.at(dim);
  chunk = (size + world - 1) / world;
  local = std::clamp<int64_t>(size - rank * chunk, 0, chunk);
  padded_local_shape = global_shape;
  padded_local_shape[dim] = chunk;
  padded_numel = 1;
  for (int64_t extent : padded_local_shape) padded_numel *= extent;
}

std::vector<int64_t> ShardLayout::local_shape() const {
  std::vector<int64_t> shape = global_shape;
  shape[dim] = local;
  return shape;
}

FSDPParam::FSDPParam(std::string name, at::Tensor variable, int64_t shard_dim, int64_t shard_world,
                     int64_t shard_rank, ParamPolicy policy)
    : name_(std::move(name)),
      variable_(std::move(variable)),
      layout_(variable_.sizes().vec(), shard_dim, shard_world, shard_rank),
      orig_dtype_(variable_.scalar_type()),
      param_dtype_(policy.param_dtype.value_or(variable_.scalar_type())),
      policy_(policy),
      // A deferred (meta) parameter lives where its recorded construction put it.
      compute_device_(deferred_device(variable_).value_or(variable_.device())) {
  c10::NoGradGuard no_grad;
  at::TensorOptions shard_options =
      variable_.options().device(compute_device_).requires_grad(false);
  if (policy_.offload) {
    shard_options = shard_options.device(at::kCPU);
    shard_options = shard_options.pinned_memory(policy_.pin_memory && compute_device_.is_cuda());
  }
  padded_shard_ = at::zeros({layout_.padded_numel}, shard_options);
  sharded_view_ =
      padded_shard_.view(layout_.padded_local_shape).narrow(layout_.dim, 0, layout_.local);
  if (variable_.is_meta()) {
    // Deferred: materialize() fills the shard later. set_data refuses meta -> real
    // (incompatible tensor types), so the variable takes over the shard in place.
    variable_.unsafeGetTensorImpl()->shallow_copy_from(sharded_view_.getIntrusivePtr());
  } else {
    load_full(variable_.detach());
  }
  install_sharded();
}

at::Tensor FSDPParam::local_part(const at::Tensor& full) const {
  const int64_t start = std::min(layout_.rank * layout_.chunk, full.size(layout_.dim));
  return full.narrow(layout_.dim, start, layout_.local);
}

void FSDPParam::load_full(const at::Tensor& full) {
  if (layout_.local == 0) return;
  c10::NoGradGuard no_grad;
  sharded_view_.copy_(local_part(full));
}

at::Tensor gather_whole(const FSDPParam& p, const at::Tensor& padded, const Group& shard_group) {
  at::Tensor gathered = at::empty({padded.numel() * p.layout().world}, padded.options());
  all_gather(gathered, padded, shard_group).wait();
  return p.assemble_full(gathered).clone();
}

at::Tensor FSDPParam::all_gather_input() const {
  return padded_shard_.to(compute_device_, param_dtype_);
}

at::Tensor FSDPParam::assemble_full(const at::Tensor& gathered) const {
  const ShardLayout& l = layout_;
  std::vector<int64_t> padded_full = l.padded_local_shape;
  padded_full[l.dim] = l.chunk * l.world;
  at::Tensor full;
  if (l.dim == 0) {
    full = gathered.view(padded_full).narrow(0, 0, l.global_shape[0]);  // no copy-out
  } else {
    std::vector<int64_t> rank_major = l.padded_local_shape;
    rank_major.insert(rank_major.begin(), l.world);
    full = gathered.view(rank_major)
               .movedim(0, l.dim)
               .reshape(padded_full)
               .narrow(l.dim, 0, l.global_shape[l.dim])
               .contiguous();
  }
  return full;
}

at::Tensor FSDPParam::post_forward_shard(int64_t index, int64_t parts) const {
  const int64_t length = gathered_.numel() / parts;
  return gathered_.narrow(0, index * length, length).clone();
}

void FSDPParam::install_unsharded(const at::Tensor& gathered) {
  at::Tensor full = assemble_full(gathered);
  gathered_ = gathered;
  if (!unsharded_) {
    stashed_sharded_grad_ = variable_.grad();
    variable_.mutable_grad() = at::Tensor();
  }
  variable_.set_data(full);
  unsharded_ = true;
}

void FSDPParam::install_sharded() {
  if (unsharded_) {
    // An unsharded gradient still on the variable was never taken for reduction
    // (no backward ran since): it must not survive the shape change.
    variable_.mutable_grad() = std::move(stashed_sharded_grad_);
    stashed_sharded_grad_ = at::Tensor();
  }
  variable_.set_data(sharded_view_);
  gathered_ = at::Tensor();
  unsharded_ = false;
}

at::Tensor& FSDPParam::sharded_grad() {
  return unsharded_ ? stashed_sharded_grad_ : variable_.mutable_grad();
}

void FSDPParam::keep_unsharded_grad(at::Tensor grad) {
  accumulated_unsharded_grad_ = grad.to(reduce_dtype(grad));
}

at::Tensor FSDPParam::take_unsharded_grad() {
  if (!unsharded_) return {};
  at::Tensor grad = variable_.grad();
  if (grad.defined()) variable_.mutable_grad() = at::Tensor();
  if (accumulated_unsharded_grad_.defined()) {
    grad =
        grad.defined()
            ? accumulated_unsharded_grad_.add_(grad.to(accumulated_unsharded_grad_.scalar_type()))
            : accumulated_unsharded_grad_;
    accumulated_unsharded_grad_ = at::Tensor();
  }
  return grad;
}

c10::ScalarType FSDPParam::reduce_dtype(const at::Tensor& unsharded_grad) const {
  return policy_.reduce_dtype.value_or(unsharded_grad.scalar_type());
}

ReduceScatterInput FSDPParam::reduce_scatter_input(const at::Tensor& unsharded_grad,
                                                   c10::ScalarType reduce_dtype) const {
  const ShardLayout& l = layout_;
  // Ownership follows from the code path, never from comparing storage pointers: .to()
  // allocates only when the dtype changes; view() never does; padding always does.
  ReduceScatterInput input;
  at::Tensor grad = unsharded_grad.to(reduce_dtype);
  input.owned = reduce_dtype != unsharded_grad.scalar_type();
  const bool aligned = l.global_shape[l.dim] == l.chunk * l.world;
  if (l.dim == 0 && aligned && grad.is_contiguous()) {
    input.flat = grad.view(-1);
    return input;
  }
  std::vector<int64_t> padded_full = l.padded_local_shape;
  padded_full[l.dim] = l.chunk * l.world;
  at::Tensor padded = at::zeros(padded_full, grad.options());
  padded.narrow(l.dim, 0, l.global_shape[l.dim]).copy_(grad);
  if (l.dim != 0) {
    std::vector<int64_t> split = l.padded_local_shape;  // dim -> (world, chunk)
    split.insert(split.begin() + l.dim, l.world);
    padded = padded.view(split).movedim(l.dim, 0).contiguous();
  }
  input.flat = padded.view(-1);
  input.owned = true;
  return input;
}

at::Tensor FSDPParam::take_partial_grad(c10::ScalarType dtype) {
  if (!grad_is_partial_) return {};
  grad_is_partial_ = false;
  // The parameter's gradient is the partial one, unless someone cleared it since.
  at::Tensor current = sharded_grad();
  main_grad_ = at::Tensor();
  sharded_grad() = at::Tensor();
  return current.defined() ? pad_local(current, dtype) : at::Tensor();
}

at::Tensor FSDPParam::pad_local(const at::Tensor& local, c10::ScalarType dtype) const {
  at::Tensor padded =
      at::zeros({layout_.padded_numel}, local.options().dtype(dtype).device(compute_device_));
  padded.view(layout_.padded_local_shape).narrow(layout_.dim, 0, layout_.local).copy_(local);
  return padded;
}

void FSDPParam::accumulate_sharded_grad(const at::Tensor& reduced, bool partial) {
  c10::NoGradGuard no_grad;
  at::Tensor local = reduced.view(layout_.padded_local_shape).narrow(layout_.dim, 0, layout_.local);
  const at::Device shard_device = padded_shard_.device();
  at::Tensor& grad = sharded_grad();
  if (!grad.defined()) grad_is_partial_ = false;  // cleared since (optimizer zero_grad)
  if (partial && grad.defined() && !grad_is_partial_) {
    throw std::logic_error(
        "parameter '" + name_ +
        "': a gradient that was not all-reduced (set_requires_all_reduce"
        "(false)) would be added to one that was; call zero_grad() before turning all-reduce off");
  }
  if (policy_.fp32_main_grad) {
    // The main grad is the parameter's gradient; once something else (an optimizer's
    // zero_grad) cleared or replaced that, accumulation starts afresh.
    if (!grad.defined() || !grad.is_same(main_grad_)) main_grad_ = at::Tensor();
    if (main_grad_.defined()) {
      main_grad_.add_(local.to(shard_device, at::kFloat));
    } else {
      main_grad_ =
          local.to(shard_device, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    }
    grad = main_grad_;
  } else if (grad.defined()) {
    grad.add_(local.to(shard_device, orig_dtype_));
  } else {
    grad = local.to(shard_device, orig_dtype_, /*non_blocking=*/false, /*copy=*/true).contiguous();
  }
  grad_is_partial_ = partial;
}

void FSDPParam::zero_grad() {
  sharded_grad() = at::Tensor();
  main_grad_ = at::Tensor();
  accumulated_unsharded_grad_ = at::Tensor();
  grad_is_partial_ = false;
}

}  // namespace hp::detail
