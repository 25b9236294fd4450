#include "fsdp_param.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "../deferred_init/deferred_init_engine.h"
#include "../distributed/tensor_storage.h"
#include "hyperparallel/collectives.h"

namespace hp::detail {

ShardLayout::ShardLayout(std::vector<int64_t> shape, int64_t shard_dim, int64_t shard_count,
                         int64_t rank_in_group)
    : global_shape(std::move(shape)), dim(shard_dim), shards(shard_count), rank(rank_in_group) {
  const int64_t size = global_shape.at(dim);
  chunk = (size + shards - 1) / shards;
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

int64_t ShardLayout::start() const { return std::min(rank * chunk, global_shape[dim]); }

int64_t ShardLayout::length_of(int64_t r) const {
  return std::clamp<int64_t>(global_shape[dim] - r * chunk, 0, chunk);
}

void ShardLayout::copy_from_rank_major(const at::Tensor& rank_major, const at::Tensor& full) const {
  std::vector<int64_t> by_rank = padded_local_shape;
  by_rank.insert(by_rank.begin(), shards);
  const at::Tensor chunks = rank_major.view(by_rank);
  for (int64_t r = 0; r < shards && length_of(r) > 0; ++r) {
    full.narrow(dim, r * chunk, length_of(r)).copy_(chunks[r].narrow(dim, 0, length_of(r)));
  }
}

void ShardLayout::copy_to_rank_major(const at::Tensor& full, const at::Tensor& rank_major,
                                     int64_t first, int64_t count) const {
  std::vector<int64_t> by_rank = padded_local_shape;
  by_rank.insert(by_rank.begin(), count);
  const at::Tensor chunks = rank_major.view(by_rank);
  for (int64_t i = 0; i < count && length_of(first + i) > 0; ++i) {
    const int64_t r = first + i;
    chunks[i].narrow(dim, 0, length_of(r)).copy_(full.narrow(dim, r * chunk, length_of(r)));
  }
}

namespace {

// A deferred (meta) parameter lives where its recorded construction put it; one on the
// CPU moves to the mesh's GPU, if it has one.
c10::Device compute_device_for(const at::Tensor& variable, const ParamPolicy& policy) {
  if (variable.is_meta() && policy.meta_moved_by_front_end) return variable.device();
  const c10::Device device = deferred_device(variable).value_or(variable.device());
  return device.is_cpu() && policy.mesh_device.is_cuda() ? policy.mesh_device : device;
}

}  // namespace

FSDPParam::FSDPParam(std::string name, at::Tensor variable, int64_t shard_dim, int64_t shard_count,
                     int64_t shard_rank, ParamPolicy policy)
    : name_(std::move(name)),
      variable_(std::move(variable)),
      layout_(variable_.sizes().vec(), shard_dim, shard_count, shard_rank),
      orig_dtype_(variable_.scalar_type()),
      param_dtype_(policy.param_dtype.value_or(variable_.scalar_type())),
      policy_(policy),
      compute_device_(compute_device_for(variable_, policy)) {
  c10::NoGradGuard no_grad;
  make_storage();
  if (!variable_.is_meta()) load_full(variable_.detach());
  point_variable_at_shard();
  if (variable_.requires_grad()) report_gradients_on_shard();
}

void FSDPParam::make_storage() {
  at::TensorOptions shard_options =
      at::TensorOptions().dtype(orig_dtype_).device(compute_device_).requires_grad(false);
  if (policy_.offload) {
    shard_options = shard_options.device(at::kCPU);
    shard_options = shard_options.pinned_memory(offloads_pinned());
  }
  padded_shard_ = at::zeros({layout_.padded_numel}, shard_options);
  sharded_view_ =
      padded_shard_.view(layout_.padded_local_shape).narrow(layout_.dim, 0, layout_.local);
  unsharded_param_ = unsharded_flat_ = at::Tensor();
  if (unsharded_aliases_shard()) return;
  const at::TensorOptions options =
      shard_options.device(compute_device_).dtype(param_dtype_).pinned_memory(false);
  if (gathers_in_place()) {
    unsharded_flat_ = at::empty({layout_.shards * layout_.padded_numel}, options);
    std::vector<int64_t> padded_full = layout_.padded_local_shape;
    padded_full[0] = layout_.chunk * layout_.shards;
    unsharded_param_ = unsharded_flat_.view(padded_full).narrow(0, 0, layout_.global_shape[0]);
  } else {
    unsharded_param_ = at::empty(layout_.global_shape, options);
    unsharded_flat_ = unsharded_param_.view(-1);
  }
  free_storage(unsharded_param_);  // allocated by the first unshard
}

void FSDPParam::point_variable_at_shard() {
  if (variable_.is_meta() || sharded_view_.is_meta()) {
    // To or from a deferred (meta) tensor: set_data refuses it (incompatible tensor types),
    // so the variable takes over the shard in place.
    variable_.unsafeGetTensorImpl()->shallow_copy_from(sharded_view_.getIntrusivePtr());
  } else {
    variable_.set_data(sharded_view_);
  }
}

void FSDPParam::move_shard(const at::Tensor& local) {
  TORCH_CHECK(!status_->unsharded, "parameter '", name_,
              "' is unsharded: reshard() its module before moving or casting it");
  TORCH_CHECK_VALUE(local.sizes().vec() == layout_.local_shape(), "parameter '", name_,
                    "': the new local shard has shape ", c10::str(local.sizes()), ", its shard ",
                    c10::str(layout_.local_shape()));
  c10::NoGradGuard no_grad;
  orig_dtype_ = local.scalar_type();
  param_dtype_ = policy_.param_dtype.value_or(orig_dtype_);
  compute_device_ = compute_device_for(local, policy_);
  make_storage();
  if (!local.is_meta()) load_local(local);
  point_variable_at_shard();
  // What belonged to the old shard does not carry over.
  variable_.mutable_grad() = at::Tensor();
  accumulated_unsharded_grad_ = main_grad_ = residual_ = at::Tensor();
  grad_is_partial_ = false;
}

void FSDPParam::report_gradients_on_shard() {
  std::weak_ptr<const Status> watched = status_;
  variable_.register_hook([watched, name = name_](const at::Tensor&) {
    auto status = watched.lock();
    if (!status || status->unsharded) return;
    C10_THROW_ERROR(
        Error,
        "parameter '" + name + "' of the fully_shard-ed module '" + status->owner +
            "' got a gradient while sharded: the module's forward ran without fully_shard's hooks "
            "(called through its plain holder: module->forward(x), a torch::nn::Sequential, or "
            "iterating a ModuleList), so the gradient would not be reduced across ranks. Call it "
            "through its hp::Sharded<...> as module(x), e.g. keep the blocks in a "
            "std::vector<hp::Sharded<Block>> and call each element");
  });
}

bool FSDPParam::unsharded_aliases_shard() const {
  return layout_.shards == 1 && !policy_.shard_group_communicates && param_dtype_ == orig_dtype_ &&
         padded_shard_.device() == compute_device_;
}

at::Tensor FSDPParam::local_part(const at::Tensor& full) const {
  return full.narrow(layout_.dim, layout_.start(), layout_.local);
}

void FSDPParam::load_full(const at::Tensor& full) { load_local(local_part(full)); }

void FSDPParam::load_local(const at::Tensor& local) {
  if (layout_.local == 0) return;
  c10::NoGradGuard no_grad;
  sharded_view_.copy_(local);
}

at::Tensor gather_whole(const FSDPParam& p, const CommBuffer& padded, const Group& shard_group) {
  const at::Tensor& part = padded.tensor;
  at::Tensor gathered = at::empty({part.numel() * p.layout().shards}, part.options());
  all_gather(gathered, part, shard_group).wait();
  if (padded.owned) free_storage(part);
  const ShardLayout& l = p.layout();
  if (l.dim == 0) {  // rank-major is the padded whole tensor: no copy
    std::vector<int64_t> padded_whole = l.padded_local_shape;
    padded_whole[0] = l.chunk * l.shards;
    return gathered.view(padded_whole).narrow(0, 0, l.global_shape[0]);
  }
  at::Tensor whole = at::empty(l.global_shape, part.options());
  l.copy_from_rank_major(gathered, whole);
  free_storage(gathered);
  return whole;
}

CommBuffer FSDPParam::all_gather_input() const {
  check_variable_holds_shard();
  const bool copied = param_dtype_ != orig_dtype_ || padded_shard_.device() != compute_device_;
  // From pinned host memory the copy is asynchronous (on the all-gather lane): the host
  // leaves the shard alone until the lanes are synchronized (end of backward).
  return {padded_shard_.to(compute_device_, param_dtype_, /*non_blocking=*/offloads_pinned()),
          copied};
}

at::Tensor FSDPParam::all_gather_output() {
  const int64_t numel = layout_.shards * layout_.padded_numel;
  if (!gathers_in_place()) return at::empty({numel}, unsharded_param_.options());
  allocate_storage(unsharded_flat_, numel * unsharded_flat_.element_size());
  return unsharded_flat_;
}

void FSDPParam::copy_out(const at::Tensor& rank_major) {
  c10::NoGradGuard no_grad;
  if (rank_major.is_same(unsharded_flat_)) return;  // gathered in place
  allocate_storage(unsharded_flat_, unsharded_flat_.numel() * unsharded_flat_.element_size());
  if (gathers_in_place()) {
    const std::vector<int64_t> by_rank = {layout_.shards, layout_.padded_numel};
    unsharded_flat_.view(by_rank).copy_(rank_major.view(by_rank));
  } else {
    layout_.copy_from_rank_major(rank_major, unsharded_param_);
  }
}

void FSDPParam::unshard_locally() {
  if (!unsharded_aliases_shard()) copy_out(all_gather_input().tensor);
}

at::Tensor FSDPParam::post_forward_part(int64_t index, int64_t parts) const {
  const int64_t count = layout_.shards / parts;
  if (gathers_in_place()) {
    const int64_t length = count * layout_.padded_numel;
    return unsharded_flat_.narrow(0, index * length, length).clone();
  }
  at::Tensor part = at::zeros({count * layout_.padded_numel}, unsharded_param_.options());
  layout_.copy_to_rank_major(unsharded_param_, part, index * count, count);
  return part;
}

int64_t FSDPParam::unsharded_bytes() const {
  if (!unsharded_param_.defined()) return 0;
  return static_cast<int64_t>(unsharded_param_.storage().nbytes());
}

void FSDPParam::check_variable_holds_shard() const {
  if (status_->unsharded || variable_.is_alias_of(padded_shard_)) return;
  C10_THROW_ERROR(
      Error,
      "parameter '" + name_ +
          "' no longer holds its local shard: something outside fully_shard replaced its data "
          "(module->to(), set_data). Move or cast the model before calling fully_shard; for "
          "lower-precision compute use mp_policy, for host memory offload_policy");
}

void FSDPParam::install_unsharded() {
  if (!status_->unsharded) {
    check_variable_holds_shard();
    stashed_sharded_grad_ = variable_.grad();
    variable_.mutable_grad() = at::Tensor();
  }
  variable_.set_data(unsharded_aliases_shard() ? sharded_view_ : unsharded_param_);
  status_->unsharded = true;
}

at::DataPtr FSDPParam::install_sharded() {
  if (status_->unsharded) {
    // An unsharded gradient still on the variable was never taken for reduction
    // (no backward ran since): it must not survive the shape change.
    variable_.mutable_grad() = std::move(stashed_sharded_grad_);
    stashed_sharded_grad_ = at::Tensor();
    variable_.set_data(sharded_view_);
    status_->unsharded = false;
  }
  // Also when never installed: an abandoned all-gather may have filled the storage.
  return unsharded_param_.defined() ? take_storage(unsharded_param_) : at::DataPtr();
}

at::Tensor& FSDPParam::sharded_grad() {
  return status_->unsharded ? stashed_sharded_grad_ : variable_.mutable_grad();
}

void FSDPParam::keep_unsharded_grad(at::Tensor grad) {
  accumulated_unsharded_grad_ = grad.to(reduce_dtype(grad));
}

at::Tensor FSDPParam::take_unsharded_grad() {
  if (!status_->unsharded) return {};
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

CommBuffer FSDPParam::reduce_scatter_input(const at::Tensor& unsharded_grad,
                                           c10::ScalarType reduce_dtype) const {
  const ShardLayout& l = layout_;
  // Ownership follows from the code path, never from comparing storage pointers: .to()
  // allocates only when the dtype changes; view() never does; padding always does.
  CommBuffer input;
  const bool aligned = l.global_shape[l.dim] == l.chunk * l.shards;
  if (l.dim == 0 && aligned && unsharded_grad.is_contiguous()) {
    input.tensor = unsharded_grad.to(reduce_dtype).view(-1);
    input.owned = reduce_dtype != unsharded_grad.scalar_type();
    return input;
  }
  // Padding is reduced along with the gradient, so it must be zero. The cast, if any,
  // happens in the same copy.
  input.tensor =
      at::zeros({l.shards * l.padded_numel}, unsharded_grad.options().dtype(reduce_dtype));
  l.copy_to_rank_major(unsharded_grad, input.tensor, 0, l.shards);
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
    C10_THROW_ERROR(Error, "parameter '" + name_ +
                               "': a gradient that was not all-reduced (set_requires_all_reduce"
                               "(false)) would be added to one that was; call zero_grad() before "
                               "turning all-reduce off");
  }
  if (policy_.fp32_main_grad) {
    // The main grad is the parameter's gradient; once something else (an optimizer's
    // zero_grad) cleared or replaced that, accumulation starts afresh.
    if (!grad.defined() || !grad.is_same(main_grad_)) main_grad_ = at::Tensor();
    if (main_grad_.defined()) {
      main_grad_.add_(local.to(shard_device, at::kFloat));
    } else {
      main_grad_ = copy_to_shard_memory(local, at::kFloat);
    }
    grad = main_grad_;
  } else if (grad.defined()) {
    grad.add_(local.to(shard_device, orig_dtype_));
  } else if (local.scalar_type() == orig_dtype_ && local.device() == shard_device &&
             local.is_contiguous()) {
    // The reduce buffer's memory, no copy. Not an autograd view of the buffer:
    // optimizers' zero_grad detach_()es gradients in place, which views refuse.
    grad = at::empty({0}, local.options())
               .set_(local.storage(), local.storage_offset(), local.sizes(), local.strides());
  } else {
    grad = copy_to_shard_memory(local, orig_dtype_);
  }
  grad_is_partial_ = partial;
}

at::Tensor FSDPParam::copy_to_shard_memory(const at::Tensor& local, c10::ScalarType dtype) const {
  if (!offloads_pinned()) {
    return local.to(padded_shard_.device(), dtype, /*non_blocking=*/false, /*copy=*/true)
        .contiguous();
  }
  // Cast and laid out on the device, then copied into pinned host memory without waiting:
  // the host reads it after the root's end-of-backward synchronization.
  at::Tensor host =
      at::empty(local.sizes(), padded_shard_.options().dtype(dtype).pinned_memory(true));
  host.copy_(local.to(dtype).contiguous(), /*non_blocking=*/true);
  return host;
}

void FSDPParam::zero_grad() {
  sharded_grad() = at::Tensor();
  main_grad_ = at::Tensor();
  accumulated_unsharded_grad_ = at::Tensor();
  grad_is_partial_ = false;
}

const at::Tensor& FSDPParam::residual_on(c10::Device device) {
  if (!residual_.defined()) {
    residual_ = at::zeros(residual_shape(), at::dtype(at::kFloat).device(device));
  } else if (residual_.device() != device) {
    residual_ = residual_.to(device);
  }
  return residual_;
}

void FSDPParam::set_residual(const at::Tensor& residual) {
  if (!residual.defined()) {
    residual_ = at::Tensor();
    return;
  }
  const std::vector<int64_t> shape = residual_shape();
  TORCH_CHECK_VALUE(
      residual.sizes() == c10::IntArrayRef(shape) && residual.scalar_type() == at::kFloat,
      "the error-feedback residual of '", name_, "' is fp32 of shape ", c10::IntArrayRef(shape),
      ", got ", residual.scalar_type(), " of shape ", residual.sizes());
  residual_ = residual.contiguous();
}

}  // namespace hp::detail
