#include "param_group.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "hyperparallel/trace.h"

namespace hp::detail {
namespace {

// Slots of the fused reduce buffer start on 512-byte boundaries, as the all-reduce
// backends prefer aligned inputs.
constexpr int64_t kSlotAlignmentBytes = 512;

// Releases the memory of a buffer this library allocated, even if a view of it is
// still referenced somewhere.
void free_storage(const at::Tensor& tensor) { tensor.storage().unsafeGetStorageImpl()->reset(); }

// Zeroes the alignment padding between the slots of a fused buffer (the columns of
// `rows`, one row per rank or a single row): it is reduced along with the slots. The
// slots themselves are overwritten in full.
void zero_between_slots(const at::Tensor& rows, const std::vector<int64_t>& offsets,
                        const std::vector<FSDPParam*>& params) {
  const int64_t total = rows.size(-1);
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t end = offsets[i] + params[i]->layout().padded_numel;
    const int64_t next = i + 1 < params.size() ? offsets[i + 1] : total;
    if (next > end) rows.narrow(-1, end, next - end).zero_();
  }
}

}  // namespace

ParamGroup::ParamGroup(std::vector<std::unique_ptr<FSDPParam>> params,
                       std::vector<ReplicatedParam> replicated, GroupComm comm, bool comm_fusion)
    : params_(std::move(params)),
      replicated_(std::move(replicated)),
      comm_(std::move(comm)),
      comm_fusion_(comm_fusion) {
  if (comm_fusion_) {
    for (const auto& p : params_) {
      if (p->param_dtype() != params_.front()->param_dtype()) {
        throw std::invalid_argument(
            "comm_fusion packs all parameters of a module into one buffer, but '" + p->name() +
            "' and '" + params_.front()->name() +
            "' have different dtypes; set mp_policy.param_dtype or turn comm_fusion off");
      }
    }
  }
}

CommHandle ParamGroup::unshard(bool async) {
  if (state_ == State::kSharded) {
    state_ = State::kPending;
    trace::record(trace::Kind::kIssue, "all_gather", label_);
    pending_unshard_ = issue_all_gather();
  }
  if (!async) wait_for_unshard();
  return state_ == State::kPending ? pending_unshard_ : CommHandle();
}

void ParamGroup::wait_for_unshard() {
  if (state_ != State::kPending) return;
  trace::record(trace::Kind::kWaitBegin, "all_gather", label_);
  pending_unshard_.wait();  // its completion installs the unsharded parameters
  trace::record(trace::Kind::kWaitEnd, "all_gather", label_);
  pending_unshard_ = CommHandle();
}

void ParamGroup::reshard() {
  if (state_ == State::kPending) {
    // Let the collective finish (its buffers are in use), but install nothing.
    state_ = State::kSharded;
    pending_unshard_.wait();
    pending_unshard_ = CommHandle();
    return;
  }
  if (state_ == State::kUnsharded) {
    for (auto& p : params_) p->install_sharded();
    state_ = State::kSharded;
  }
  post_forward_shards_.clear();
}

void ParamGroup::reshard_to_post_forward_group() {
  wait_for_unshard();
  if (state_ != State::kUnsharded) return;
  const int64_t parts = post_forward_group_->size();
  std::vector<at::Tensor> kept;
  for (auto& p : params_) kept.push_back(p->post_forward_shard(post_forward_group_->rank(), parts));
  reshard();
  post_forward_shards_ = std::move(kept);
}

CommHandle ParamGroup::issue_all_gather() {
  const Group& group = *comm_.shard;
  const int64_t world = group.size();
  // Every path installs only if the unshard is still wanted when it completes.
  if (world == 1 || params_.empty()) {
    // No communication: record the pending unshard; materialise from the latest shard
    // when someone waits (seed 000).
    return CommHandle::deferred([this] {
      if (state_ != State::kPending) return;
      for (auto& p : params_) p->install_unsharded(p->all_gather_input());
      state_ = State::kUnsharded;
    });
  }
  if (!post_forward_shards_.empty()) {
    // Resharded to a smaller group after forward: gather within it only.
    std::vector<at::Tensor> outputs;
    std::vector<CommHandle> gathers;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& part = post_forward_shards_[i];
      outputs.push_back(at::empty({part.numel() * post_forward_group_->size()}, part.options()));
      gathers.push_back(all_gather(outputs.back(), part, *post_forward_group_));
    }
    post_forward_shards_.clear();
    return install_when_done(std::move(outputs), std::move(gathers));
  }
  if (!comm_fusion_) {
    // One all-gather per parameter, straight from the shard into the unsharded
    // buffer: no copy-in, and for Shard(0) no copy-out either.
    std::vector<at::Tensor> outputs;
    std::vector<CommHandle> gathers;
    for (auto& p : params_) {
      at::Tensor input = p->all_gather_input();
      outputs.push_back(at::empty({world * p->layout().padded_numel}, input.options()));
      gathers.push_back(all_gather(outputs.back(), input, group));
    }
    return install_when_done(std::move(outputs), std::move(gathers));
  }
  // comm_fusion: copy the shards into one input, one all-gather, copy out per param.
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (auto& p : params_) {
    offsets.push_back(total);
    total += p->layout().padded_numel;
  }
  const at::Tensor first = params_.front()->all_gather_input();
  at::Tensor input = at::empty({total}, first.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    input.narrow(0, offsets[i], params_[i]->layout().padded_numel)
        .copy_(params_[i]->all_gather_input());
  }
  at::Tensor output = at::empty({world * total}, input.options());
  CommHandle gather = all_gather(output, input, group);
  return CommHandle::after({gather}, [this, input, output, offsets, world, total] {
    if (state_ == State::kPending) {
      at::Tensor by_rank = output.view({world, total});
      for (size_t i = 0; i < params_.size(); ++i) {
        const int64_t n = params_[i]->layout().padded_numel;
        params_[i]->install_unsharded(by_rank.narrow(1, offsets[i], n).contiguous().view(-1));
      }
      state_ = State::kUnsharded;
    }
    // The fused buffers are released right after copy-out.
    free_storage(output);
    free_storage(input);
  });
}

CommHandle ParamGroup::install_when_done(std::vector<at::Tensor> outputs,
                                         std::vector<CommHandle> gathers) {
  return CommHandle::after(std::move(gathers), [this, outputs] {
    if (state_ != State::kPending) return;
    for (size_t i = 0; i < params_.size(); ++i) params_[i]->install_unsharded(outputs[i]);
    state_ = State::kUnsharded;
  });
}

void ParamGroup::stash_replicated_grads() {
  for (auto& rp : replicated_) {
    // The variable's gradient is what the user last saw (an optimizer's zero_grad may
    // have cleared it): that, not an older copy, is what new gradients add to.
    rp.reduced_grad = rp.variable.grad();
    rp.variable.mutable_grad() = at::Tensor();
  }
}

void ParamGroup::start_replicated_reduce(const ReduceSettings& settings) {
  for (auto& rp : replicated_) {
    at::Tensor grad = rp.variable.grad();
    rp.variable.mutable_grad() = rp.reduced_grad;
    if (!grad.defined() || !rp.variable.requires_grad()) continue;
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
    pending_->replicated_all_reduces.push_back(
        all_reduce(grad, ReduceOp::kSum, *comm_.data_parallel));
  }
}

void ParamGroup::start_reduce(const ReduceSettings& settings) {
  if (pending_) {
    throw std::logic_error("a gradient reduction is still pending for this module");
  }
  pending_.emplace();
  PendingReduce& r = *pending_;
  r.settings = settings;
  std::vector<at::Tensor> grads;
  for (auto& p : params_) {
    if (!p->requires_grad()) continue;  // frozen: never reduced
    at::Tensor grad = p->take_unsharded_grad();
    if (!grad.defined()) continue;
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
  trace::record(trace::Kind::kIssue, "reduce_scatter", label_);

  const c10::ScalarType dtype = r.params.front()->reduce_dtype(grads.front());
  const int64_t align = std::max<int64_t>(1, kSlotAlignmentBytes / c10::elementSize(dtype));
  int64_t total = 0;
  for (FSDPParam* p : r.params) {
    r.offsets.push_back(total);
    total += (p->layout().padded_numel + align - 1) / align * align;
  }
  const at::TensorOptions options = grads.front().options().dtype(dtype);
  r.buffer = at::empty({total}, options);
  const Group& reduce = *comm_.shard_reduce;
  const int64_t world = reduce.size();
  if (comm_fusion_ && world > 1) {
    // One reduce-scatter: rank-major input laid out like the buffer, so its output
    // lands in the buffer as is.
    at::Tensor input = at::empty({world, total}, options);
    zero_between_slots(input, r.offsets, r.params);
    for (size_t i = 0; i < r.params.size(); ++i) {
      ReduceScatterInput part = r.params[i]->reduce_scatter_input(grads[i], dtype);
      const int64_t n = r.params[i]->layout().padded_numel;
      input.narrow(1, r.offsets[i], n).copy_(part.flat.view({world, n}));
      // Copied: released now rather than after the collective, so that the fused
      // input does not double the gradient memory of a reduction in flight.
      release_reduce_input(part);
      grads[i] = at::Tensor();
    }
    r.inputs.push_back({input.view(-1), /*owned=*/true});
    r.reduce_scatters.push_back(reduce_scatter(r.buffer, input.view(-1), ReduceOp::kSum, reduce));
    return;
  }
  zero_between_slots(r.buffer, r.offsets, r.params);
  for (size_t i = 0; i < r.params.size(); ++i) {
    ReduceScatterInput part = r.params[i]->reduce_scatter_input(grads[i], dtype);
    at::Tensor slot = r.buffer.narrow(0, r.offsets[i], r.params[i]->layout().padded_numel);
    r.reduce_scatters.push_back(reduce_scatter(slot, part.flat, ReduceOp::kSum, reduce));
    r.inputs.push_back(std::move(part));
  }
}

void ParamGroup::release_reduce_input(ReduceScatterInput& input) {
  // Seed 002: only what this library allocated is freed; a view of the caller's
  // gradient is merely dropped.
  if (input.owned) {
    free_storage(input.flat);
    ++stats_.freed_owned;
  } else {
    ++stats_.kept_aliased;
  }
  input.flat = at::Tensor();
}

void ParamGroup::wait_reduce_scatter() {
  if (!pending_ || pending_->reduce_scatters_done) return;
  PendingReduce& r = *pending_;
  r.reduce_scatters_done = true;
  if (!r.reduce_scatters.empty()) trace::record(trace::Kind::kWaitBegin, "reduce_scatter", label_);
  for (auto& handle : r.reduce_scatters) handle.wait();
  if (!r.reduce_scatters.empty()) trace::record(trace::Kind::kWaitEnd, "reduce_scatter", label_);
  for (auto& input : r.inputs) release_reduce_input(input);
  r.inputs.clear();
  if (r.params.empty()) return;
  // Dividing before the all-reduce keeps partial (not all-reduced) gradients on the
  // same scale as complete ones.
  if (r.settings.divide_factor != 1.0) r.buffer.div_(r.settings.divide_factor);
  const bool has_replicas = comm_.replicate->size() > 1;
  if (!has_replicas || !r.settings.all_reduce) {
    r.partial = has_replicas;
    install_sharded_grads(r);
  }
}

void ParamGroup::start_all_reduce() {
  wait_reduce_scatter();
  if (!pending_ || pending_->all_reduce_started) return;
  PendingReduce& r = *pending_;
  r.all_reduce_started = true;
  if (r.params.empty()) return;  // installed already: nothing to all-reduce
  for (size_t i = 0; i < r.params.size(); ++i) {
    at::Tensor partial = r.params[i]->take_partial_grad(r.buffer.scalar_type());
    if (partial.defined()) r.buffer.narrow(0, r.offsets[i], partial.numel()).add_(partial);
  }
  // Zero-copy: the reduce-scatters wrote into this buffer; one all-reduce covers it.
  trace::record(trace::Kind::kIssue, "all_reduce", label_);
  r.all_reduce = all_reduce(r.buffer, ReduceOp::kSum, *comm_.replicate);
}

void ParamGroup::install_sharded_grads(PendingReduce& r) {
  for (size_t i = 0; i < r.params.size(); ++i) {
    at::Tensor slot = r.buffer.narrow(0, r.offsets[i], r.params[i]->layout().padded_numel);
    r.params[i]->accumulate_sharded_grad(slot, r.partial);
  }
  r.params.clear();
}

void ParamGroup::finish_reduce() {
  if (!pending_) return;
  start_all_reduce();
  PendingReduce r = std::move(*pending_);
  pending_.reset();
  if (r.all_reduce.pending()) {
    trace::record(trace::Kind::kWaitBegin, "all_reduce", label_);
    r.all_reduce.wait();
    trace::record(trace::Kind::kWaitEnd, "all_reduce", label_);
  }
  install_sharded_grads(r);
  for (size_t i = 0; i < r.replicated.size(); ++i) {
    r.replicated_all_reduces[i].wait();
    auto& [rp, grad] = r.replicated[i];
    if (r.settings.divide_factor != 1.0) grad.div_(r.settings.divide_factor);
    rp->reduced_grad = rp->reduced_grad.defined() ? rp->reduced_grad.add_(grad) : grad;
    rp->variable.mutable_grad() = rp->reduced_grad;
  }
}

void ParamGroup::zero_grad() {
  finish_reduce();  // a reduction still in flight would land after the clear
  for (auto& p : params_) p->zero_grad();
  for (auto& rp : replicated_) {
    rp.variable.mutable_grad() = at::Tensor();
    rp.reduced_grad = at::Tensor();
    rp.unsynced_grad = at::Tensor();
  }
}

}  // namespace hp::detail
