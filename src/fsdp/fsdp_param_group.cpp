#include "fsdp_param_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <utility>

#include "../distributed/thread_wire_bytes.h"
#include "../trace/trace_recording.h"
#include "fsdp_collectives.h"
#include "hyperparallel/collectives.h"

namespace hp::detail {
namespace {

// `handle`, whose completion then divides `result` (the reduced gradients) by `factor`:
// on a GPU the completion runs on the collective's lane, so the division does too.
CommHandle divided_when_done(CommHandle handle, at::Tensor result, double factor) {
  return CommHandle::after({std::move(handle)}, [result, factor]() mutable {
    if (factor != 1.0) result.div_(factor);
  });
}

}  // namespace

ReplicatedParam::ReplicatedParam(std::string name, at::Tensor variable, const ParamPolicy& policy)
    : name(std::move(name)),
      variable(std::move(variable)),
      compute_dtype(this->variable.scalar_type()),
      reduce_dtype(policy.reduce_dtype),
      fp32_main_grad(policy.fp32_main_grad) {
  if (policy.param_dtype && at::isFloatingType(compute_dtype)) compute_dtype = *policy.param_dtype;
}

FSDPParamGroup::FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params,
                               std::vector<ReplicatedParam> replicated, FSDPMeshInfo mesh_info,
                               CommFusion comm_fusion, CommPolicy comm_policy)
    : params_(std::move(params)),
      replicated_(std::move(replicated)),
      mesh_info_(std::move(mesh_info)),
      comm_fusion_(comm_fusion),
      comm_policy_(comm_policy),
      streams_(std::make_shared<CommStreams>(mesh_info_.device)) {
  if (comm_fusion_.enabled) {
    for (const auto& p : params_) {
      if (p->param_dtype() != params_.front()->param_dtype()) {
        C10_THROW_ERROR(
            ValueError,
            "comm_fusion packs all parameters of a module into one buffer, but '" + p->name() +
                "' and '" + params_.front()->name() +
                "' have different dtypes; set mp_policy.param_dtype or turn comm_fusion off");
      }
    }
  }
}

bool FSDPParamGroup::offloads() const {
  for (const auto& p : params_) {
    if (p->offloads()) return true;
  }
  return false;
}

void FSDPParamGroup::set_label(std::string label) {
  for (auto& p : params_) p->set_owner(label);
  label_ = std::move(label);
}

CommHandle FSDPParamGroup::unshard(bool async) {
  if (state_ == State::kSharded) {
    state_ = State::kPending;
    try {
      pending_unshard_ = issue_all_gather();
    } catch (...) {  // e.g. out of memory for the unsharded storage: stay sharded
      reshard();
      throw;
    }
  }
  if (!async) wait_for_unshard();
  return state_ == State::kPending ? pending_unshard_ : CommHandle();
}

void FSDPParamGroup::wait_for_unshard() {
  if (state_ != State::kPending) return;
  trace::record(trace::Kind::kWaitBegin, "all_gather", label_);
  try {
    pending_unshard_.wait();  // its completion installs the unsharded parameters
  } catch (...) {
    // The collective or its completion (copy-out, install) failed: back to sharded, so
    // that the next unshard starts afresh instead of finding a pending state forever.
    state_ = State::kSharded;
    pending_unshard_ = CommHandle();
    install_sharded();
    throw;
  }
  trace::record(trace::Kind::kWaitEnd, "all_gather", label_);
  pending_unshard_ = CommHandle();
}

void FSDPParamGroup::reshard() {
  // A pending collective is let finish (its buffers are in use) but installs nothing
  // (its completion checks the state); what it gathered is freed below.
  CommHandle abandoned = std::exchange(pending_unshard_, CommHandle());
  state_ = State::kSharded;
  post_forward_parts_.clear();
  std::exception_ptr error;
  try {
    abandoned.wait();
  } catch (...) {
    error = std::current_exception();
  }
  // Sharded parameters may still hold gathered storage: a pending unshard was abandoned.
  install_sharded();
  if (error) std::rethrow_exception(error);
}

void FSDPParamGroup::reshard_to_post_forward_group() {
  wait_for_unshard();
  if (state_ != State::kUnsharded) return;
  const int64_t parts = post_forward_group_->size();
  std::vector<at::Tensor> kept;
  for (auto& p : params_) kept.push_back(p->post_forward_part(post_forward_group_->rank(), parts));
  reshard();
  post_forward_parts_ = std::move(kept);
}

CommHandle FSDPParamGroup::issue_all_gather() {
  // Every path installs only if the unshard is still wanted when it completes.
  if (!mesh_info_.shard->communicates() || params_.empty()) {
    trace::record(trace::Kind::kIssue, "all_gather", label_);
    // No communication: record the pending unshard; materialise from the latest shard
    // when someone waits.
    return CommHandle::deferred([this] {
      if (state_ != State::kPending) return;
      for (auto& p : params_) p->unshard_locally();
      install_unsharded();
    });
  }
  std::vector<FSDPParam*> params;
  for (auto& p : params_) params.push_back(p.get());
  // The parts kept after forward were cut by compute: the lane reads them after it. The
  // shards need no such wait (the root orders the lanes after the optimizer's update).
  c10::OptionalStreamGuard on_lane =
      streams_->enter(Lane::kAllGather, /*after_compute=*/!post_forward_parts_.empty());
  // With the lane current: on a GPU the issue is timed where the lane starts it.
  trace::record(trace::Kind::kIssue, "all_gather", label_);
  const int64_t sent_before = detail::wire_bytes_sent_by_this_thread();
  std::vector<CommBuffer> inputs;
  const Group* group = mesh_info_.shard.get();
  if (!post_forward_parts_.empty()) {
    // Resharded to a smaller group after forward: gather within it only.
    for (at::Tensor& part : post_forward_parts_) inputs.push_back({std::move(part), true});
    post_forward_parts_.clear();
    group = post_forward_group_.get();
  } else {
    for (FSDPParam* p : params) inputs.push_back(p->all_gather_input());
  }
  auto result = std::make_shared<AllGatherResult>(all_gather_params(
      params, inputs, *group, group == mesh_info_.shard.get() ? comm_fusion_ : CommFusion{},
      comm_policy_));
  trace::record_bytes("all_gather", label_, detail::wire_bytes_sent_by_this_thread() - sent_before);
  result->handle = streams_->complete_on_lane(Lane::kAllGather, std::move(result->handle));
  return CommHandle::after({result->handle}, [this, params, result] {
    if (state_ != State::kPending) return;
    copy_out_all_gather(params, *result, *streams_);
    install_unsharded();
  });
}

void FSDPParamGroup::install_unsharded() {
  for (auto& p : params_) p->install_unsharded();
  for (auto& rp : replicated_) {
    if (rp.compute_dtype == rp.variable.scalar_type() || rp.own_data.defined()) continue;
    c10::NoGradGuard no_grad;
    rp.own_data = rp.variable.data();
    rp.variable.set_data(rp.own_data.to(rp.compute_dtype));
  }
  state_ = State::kUnsharded;
}

void FSDPParamGroup::install_sharded() {
  for (auto& rp : replicated_) {
    if (rp.own_data.defined()) rp.variable.set_data(std::exchange(rp.own_data, at::Tensor()));
  }
  std::vector<at::DataPtr> memory;
  for (auto& p : params_) memory.push_back(p->install_sharded());
  // Without communication the storage came from the compute stream: freed now.
  if (!mesh_info_.shard->communicates()) return;
  streams_->release_after_compute(Lane::kAllGather, std::move(memory));
}

void FSDPParamGroup::stash_replicated_grads() {
  for (auto& rp : replicated_) {
    // The variable's gradient is what the user last saw (an optimizer's zero_grad may
    // have cleared it): that, not an older copy, is what new gradients add to.
    rp.reduced_grad = rp.variable.grad();
    rp.variable.mutable_grad() = at::Tensor();
  }
}

void FSDPParamGroup::start_replicated_reduce(const ReduceSettings& settings) {
  for (auto& rp : replicated_) {
    at::Tensor grad = rp.variable.grad();
    rp.variable.mutable_grad() = rp.reduced_grad;
    if (!grad.defined() || !rp.variable.requires_grad()) continue;
    grad = grad.to(rp.reduce_dtype.value_or(grad.scalar_type()));
    if (rp.unsynced_grad.defined()) {
      grad = rp.unsynced_grad.add_(grad);
      rp.unsynced_grad = at::Tensor();
    }
    if (!settings.sync) {
      rp.unsynced_grad = grad;
      continue;
    }
    grad = grad.contiguous();
    pending_->replicated.emplace_back(&rp, grad);
    c10::OptionalStreamGuard on_lane = streams_->enter(Lane::kAllReduce, /*after_compute=*/true);
    const DivideFactors divide = split_divide_factor(settings.divide_factor, grad.scalar_type());
    if (divide.before != 1.0) grad.div_(divide.before);
    pending_->replicated_all_reduces.push_back(streams_->complete_on_lane(
        Lane::kAllReduce,
        divided_when_done(all_reduce(grad, ReduceOp::kSum, *mesh_info_.data_parallel), grad,
                          divide.after)));
  }
}

void FSDPParamGroup::start_reduce(const ReduceSettings& settings) {
  if (pending_) {
    C10_THROW_ERROR(Error, "a gradient reduction is still pending for this module");
  }
  pending_.emplace();
  try {
    issue_reduce(settings);
  } catch (...) {
    discard_reduce();
    throw;
  }
}

void FSDPParamGroup::issue_reduce(const ReduceSettings& settings) {
  PendingReduce& r = *pending_;
  r.settings = settings;
  std::vector<at::Tensor> grads;
  for (auto& p : params_) {
    if (!p->requires_grad()) continue;  // frozen: never reduced
    at::Tensor grad = p->take_unsharded_grad();
    if (!grad.defined()) {
      if (!settings.sync || !p->unsharded()) continue;
      // Unused on this rank (a branch not taken, an expert without tokens) but maybe not on
      // the others: every rank reduces the same parameters, or the collectives would not
      // match (a hang on NCCL). This rank's part is zeros.
      grad = at::zeros_like(p->variable());
    }
    if (!settings.sync) {
      p->keep_unsharded_grad(std::move(grad));
      continue;
    }
    r.params.push_back(p.get());
    grads.push_back(std::move(grad));
  }
  start_replicated_reduce(settings);
  if (r.params.empty()) {
    if (r.replicated.empty()) pending_.reset();  // nothing to reduce (sync off, frozen)
    return;
  }
  const c10::ScalarType dtype = r.params.front()->reduce_dtype(grads.front());
  const DivideFactors divide = split_divide_factor(settings.divide_factor, dtype);
  // The gradients come from compute; copy-in, padding and the collectives run on the lane.
  c10::OptionalStreamGuard on_lane = streams_->enter(Lane::kReduceScatter, /*after_compute=*/true);
  trace::record(trace::Kind::kIssue, "reduce_scatter", label_);
  const int64_t sent_before = detail::wire_bytes_sent_by_this_thread();
  if (comm_policy_.error_feedback &&
      (!dropped_residual_blocks_.defined() ||
       dropped_residual_blocks_.device() != grads.front().device())) {
    dropped_residual_blocks_ =
        dropped_residual_blocks_.defined()
            ? dropped_residual_blocks_.to(grads.front().device())
            : at::zeros({}, at::dtype(at::kLong).device(grads.front().device()));
  }
  r.scatter =
      reduce_scatter_grads(r.params, std::move(grads), dtype, *mesh_info_.shard_reduce,
                           divide.before, comm_fusion_, comm_policy_, dropped_residual_blocks_,
                           /*keep_grads=*/streams_->active(), stats_);
  trace::record_bytes("reduce_scatter", label_,
                      detail::wire_bytes_sent_by_this_thread() - sent_before);
  // Dividing before the all-reduce keeps partial (not all-reduced) gradients on the
  // same scale as complete ones. On a GPU the division runs on the lane too.
  r.scatter.handle = streams_->complete_on_lane(
      Lane::kReduceScatter, divided_when_done(r.scatter.handle, r.scatter.buffer, divide.after));
}

void FSDPParamGroup::set_residual(FSDPParam& param, const at::Tensor& residual) {
  check_error_feedback();
  param.set_residual(residual);
}

int64_t FSDPParamGroup::dropped_residual_blocks() const {
  return dropped_residual_blocks_.defined() ? dropped_residual_blocks_.item<int64_t>() : 0;
}

void FSDPParamGroup::check_error_feedback() const {
  TORCH_CHECK_VALUE(comm_policy_.error_feedback, "fully_shard module '", label_,
                    "' keeps no error-feedback residual (CommPolicy::error_feedback is off)");
}

void FSDPParamGroup::reset_error_feedback() {
  check_error_feedback();
  for (auto& param : params_) param->set_residual({});
  dropped_residual_blocks_ = at::Tensor();
}

void FSDPParamGroup::wait_reduce_scatter() {
  if (!pending_ || pending_->reduce_scatters_done) return;
  PendingReduce& r = *pending_;
  r.reduce_scatters_done = true;
  if (r.scatter.handle.pending()) {
    trace::record(trace::Kind::kWaitBegin, "reduce_scatter", label_);
    try {
      r.scatter.handle.wait();
    } catch (...) {
      discard_reduce();  // its buffer holds no result: never install it
      throw;
    }
    trace::record(trace::Kind::kWaitEnd, "reduce_scatter", label_);
  }
  release_reduce_inputs(r.scatter, stats_);
  if (r.params.empty()) return;
  const bool has_replicas = mesh_info_.replicate->communicates();
  if (!has_replicas || !r.settings.all_reduce) {
    r.partial = has_replicas;
    install_sharded_grads(r);
  }
}

void FSDPParamGroup::start_all_reduce() {
  wait_reduce_scatter();
  if (!pending_ || pending_->all_reduce_started) return;
  PendingReduce& r = *pending_;
  r.all_reduce_started = true;
  if (r.params.empty()) return;  // installed already: nothing to all-reduce
  for (size_t i = 0; i < r.params.size(); ++i) {
    at::Tensor partial = r.params[i]->take_partial_grad(r.scatter.buffer.scalar_type());
    if (partial.defined())
      r.scatter.buffer.narrow(0, r.scatter.offsets[i], partial.numel()).add_(partial);
  }
  // Zero-copy: the reduce-scatters wrote into this buffer; one all-reduce covers it.
  try {
    // After compute, which added the partial gradients (and waited for the reduce-scatter).
    c10::OptionalStreamGuard on_lane = streams_->enter(Lane::kAllReduce, /*after_compute=*/true);
    trace::record(trace::Kind::kIssue, "all_reduce", label_);
    const int64_t sent_before = detail::wire_bytes_sent_by_this_thread();
    r.all_reduce = streams_->complete_on_lane(
        Lane::kAllReduce, all_reduce(r.scatter.buffer, ReduceOp::kSum, *mesh_info_.replicate));
    trace::record_bytes("all_reduce", label_,
                        detail::wire_bytes_sent_by_this_thread() - sent_before);
  } catch (...) {
    discard_reduce();
    throw;
  }
}

void FSDPParamGroup::install_sharded_grads(PendingReduce& r) {
  // Offloaded gradients are copied to host memory on the reduce-scatter lane, after the
  // compute that waited for the reduction, so that compute does not queue behind them.
  c10::OptionalStreamGuard on_lane =
      offloads() ? streams_->enter(Lane::kReduceScatter, /*after_compute=*/true)
                 : c10::OptionalStreamGuard();
  install_reduced_grads(r.params, r.scatter.buffer, r.scatter.offsets, r.partial);
  r.params.clear();
}

void FSDPParamGroup::finish_reduce() {
  if (!pending_) return;
  start_all_reduce();
  PendingReduce& pending = *pending_;
  try {
    if (pending.all_reduce.pending()) {
      trace::record(trace::Kind::kWaitBegin, "all_reduce", label_);
      pending.all_reduce.wait();
      trace::record(trace::Kind::kWaitEnd, "all_reduce", label_);
    }
    for (CommHandle& handle : pending.replicated_all_reduces) handle.wait();
  } catch (...) {
    discard_reduce();
    throw;
  }
  PendingReduce r = std::move(pending);
  pending_.reset();
  install_sharded_grads(r);
  for (auto& [rp, all_reduced] : r.replicated) {
    const at::Tensor grad = all_reduced.to(rp->grad_dtype());
    rp->reduced_grad = rp->reduced_grad.defined() ? rp->reduced_grad.add_(grad) : grad;
    rp->variable.mutable_grad() = rp->reduced_grad;
  }
}

void FSDPParamGroup::discard_reduce() {
  if (!pending_) return;
  PendingReduce r = std::move(*pending_);
  pending_.reset();
  // Collectives still in flight write into the buffers dropped here: let them finish.
  std::vector<CommHandle> issued = {r.scatter.handle, r.all_reduce};
  issued.insert(issued.end(), r.replicated_all_reduces.begin(), r.replicated_all_reduces.end());
  wait_issued(issued);
  release_reduce_inputs(r.scatter, stats_);
}

void FSDPParamGroup::zero_grad() {
  finish_reduce();  // a reduction still in flight would land after the clear
  for (auto& p : params_) p->zero_grad();
  for (auto& rp : replicated_) {
    rp.variable.mutable_grad() = at::Tensor();
    rp.reduced_grad = at::Tensor();
    rp.unsynced_grad = at::Tensor();
  }
}

}  // namespace hp::detail
