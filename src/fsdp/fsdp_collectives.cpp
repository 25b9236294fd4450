#include "fsdp_collectives.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "../distributed/group_access.h"
#include "../distributed/tensor_storage.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/quantized_collectives.h"

namespace hp::detail {
namespace {

// Slots of the fused reduce buffer start on 512-byte boundaries, as the all-reduce
// backends prefer aligned inputs.
constexpr int64_t kSlotAlignmentBytes = 512;

// Zeroes the alignment padding between the slots of `bucket` in `rows` (its columns, one
// row per rank or a single row), where parameter i's slot starts at offsets[i] and holds
// widths[i] elements: it is reduced along with the slots, which are overwritten in full.
void zero_between_slots(const at::Tensor& rows, const FusionBucket& bucket,
                        const std::vector<int64_t>& offsets, const std::vector<int64_t>& widths) {
  for (size_t i = bucket.first; i < bucket.last; ++i) {
    const int64_t end = offsets[i] + widths[i];
    const int64_t next = i + 1 < bucket.last ? offsets[i + 1] : bucket.end;
    if (next > end) rows.narrow(-1, end - bucket.begin, next - end).zero_();
  }
}

// Frees a reduce-scatter input this library allocated (a view of the caller's gradient
// is only dropped: the caller still owns it).
void release_copied_input(const CommBuffer& input, ReduceBufferStats& stats) {
  if (input.owned) {
    free_storage(input.tensor);
    ++stats.freed_owned;
  } else {
    ++stats.kept_aliased;
  }
}

// A bucket's rank-major [shards x bucket elements] part of a fused buffer laid out bucket
// after bucket.
at::Tensor bucket_rows(const at::Tensor& flat, const FusionBucket& bucket, int64_t shards) {
  const int64_t length = bucket.end - bucket.begin;
  return flat.narrow(0, shards * bucket.begin, shards * length).view({shards, length});
}

// Per parameter i of `bucket`, its [shards x widths[i]] columns of the bucket's rows of
// `flat`, where parameter i starts at offsets[i].
std::vector<at::Tensor> bucket_columns(const at::Tensor& flat, const FusionBucket& bucket,
                                       int64_t shards, const std::vector<int64_t>& offsets,
                                       const std::vector<int64_t>& widths) {
  const at::Tensor rows = bucket_rows(flat, bucket, shards);
  std::vector<at::Tensor> columns;
  for (size_t i = bucket.first; i < bucket.last; ++i) {
    columns.push_back(rows.narrow(1, offsets[i] - bucket.begin, widths[i]));
  }
  return columns;
}

// Issues `count` collectives, `issue_one(i)` each, over `group` as one coalesced group
// where the backend has them (NCCL: one group call, so that many small collectives cost
// one launch); Gloo has none and runs them one by one, and a one-rank group may have no
// backend. A failure part way waits for the collectives already issued (they write into
// buffers the caller is about to drop) and ends the group before it propagates.
template <typename IssueOne>
CommHandle issue_coalesced(const Group& group, c10::DeviceType device, size_t count,
                           IssueOne&& issue_one) {
  c10d::Backend* backend = nullptr;
  if (group.communicates() && GroupAccess::backend(group, device).supportsCoalescing()) {
    backend = &GroupAccess::backend(group, device);
    backend->startCoalescing();
  }
  std::vector<CommHandle> issued;
  try {
    for (size_t i = 0; i < count; ++i) issued.push_back(issue_one(i));
  } catch (...) {
    wait_issued(issued);
    try {
      if (backend) CommHandle::from_work(backend->endCoalescing()).wait();
    } catch (...) {  // secondary to the error that led here
    }
    throw;
  }
  if (backend) {
    issued.push_back(
        CommHandle::from_work(backend->endCoalescing(), {},
                              GroupAccess::on_failure(group, "coalesced collectives", *backend)));
  }
  return CommHandle::after(std::move(issued), {});
}

// Per-parameter all-gather: each shard straight into its parameter's output. Quantized,
// each parameter still has blocks of its own, but they travel together: one small message
// per parameter would cost a round trip each on a TCP link.
void gather_each_parameter(const std::vector<FSDPParam*>& params,
                           const std::vector<CommBuffer>& inputs, const Group& group,
                           const CommPolicy& policy, AllGatherResult& result) {
  std::vector<at::Tensor> shards;
  for (size_t i = 0; i < params.size(); ++i) {
    result.outputs.push_back(params[i]->all_gather_output());
    if (!params[i]->gathers_in_place()) result.temporaries.push_back(result.outputs.back());
    shards.push_back(inputs[i].tensor);
  }
  if (policy.all_gather_codec != CommCodec::kNone) {
    result.handle = quantized_all_gather_coalesced(result.outputs, shards, group,
                                                   policy.all_gather_codec, policy.block_size);
    return;
  }
  result.handle =
      issue_coalesced(group, shards.front().device().type(), shards.size(),
                      [&](size_t i) { return all_gather(result.outputs[i], shards[i], group); });
}

// comm_fusion's all-gather: the inputs copied into one buffer and gathered bucket after
// bucket, each rank-major, so that every bucket's all-gather lands in place.
void gather_fused(const std::vector<CommBuffer>& inputs, const Group& group,
                  const CommFusion& fusion, const CommPolicy& policy, AllGatherResult& result) {
  std::vector<int64_t> offsets, widths;
  int64_t total = 0;
  for (const CommBuffer& input : inputs) {
    offsets.push_back(total);
    widths.push_back(input.tensor.numel());
    total += widths.back();
  }
  at::Tensor input = at::empty({total}, inputs.front().tensor.options());
  for (size_t i = 0; i < inputs.size(); ++i) {
    input.narrow(0, offsets[i], widths[i]).copy_(inputs[i].tensor);
  }
  const int64_t shards = group.size();
  at::Tensor output = at::empty({shards * total}, input.options());
  const std::vector<FusionBucket> buckets =
      fusion_buckets(offsets, total, fusion.bucket_bytes,
                     {input.element_size(), policy.all_gather_codec, policy.block_size});
  for (const FusionBucket& bucket : buckets) {
    for (at::Tensor& column : bucket_columns(output, bucket, shards, offsets, widths)) {
      result.outputs.push_back(std::move(column));
    }
  }
  result.temporaries.push_back(input);
  result.temporaries.push_back(output);
  result.handle = issue_coalesced(group, input.device().type(), buckets.size(), [&](size_t b) {
    const at::Tensor rows = bucket_rows(output, buckets[b], shards).view(-1);
    const at::Tensor part = input.narrow(0, buckets[b].begin, buckets[b].end - buckets[b].begin);
    if (policy.all_gather_codec == CommCodec::kNone) return all_gather(rows, part, group);
    return quantized_all_gather(rows, part, group, policy.all_gather_codec, policy.block_size);
  });
}

// What every collective of one gradient reduction shares.
struct Reduction {
  const Group& group;
  const CommPolicy& policy;
  const at::Tensor& dropped_blocks;
};

// Per-parameter reduce-scatter inputs: each gradient laid out for its reduce-scatter and
// divided in place (the input is this reduction's own: a copy, or the unsharded gradient
// that is dropped once reduced). The gradients move into result.grads with `keep_grads`.
std::vector<at::Tensor> take_inputs_each(const std::vector<FSDPParam*>& params,
                                         std::vector<at::Tensor>& grads, double divide_before,
                                         bool keep_grads, ReduceScatterResult& result) {
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < params.size(); ++i) {
    CommBuffer part = params[i]->reduce_scatter_input(grads[i], result.buffer.scalar_type());
    if (keep_grads) result.grads.push_back(std::move(grads[i]));
    grads[i] = at::Tensor();
    if (divide_before != 1.0) part.tensor.div_(divide_before);
    parts.push_back(part.tensor);
    result.inputs.push_back(std::move(part));
  }
  return parts;
}

// Per-parameter reduce-scatter: each gradient's input into its slot of result.buffer.
// `parts` are the inputs (result.inputs' tensors).
void reduce_each_parameter(const std::vector<FSDPParam*>& params,
                           const std::vector<at::Tensor>& parts, const Reduction& reduction,
                           ReduceScatterResult& result) {
  std::vector<at::Tensor> slots, residuals;
  for (size_t i = 0; i < params.size(); ++i) {
    slots.push_back(result.buffer.narrow(0, result.offsets[i], params[i]->layout().padded_numel));
    if (reduction.policy.error_feedback) {
      residuals.push_back(params[i]->residual_on(parts[i].device()).view(-1));
    }
  }
  const CommPolicy& policy = reduction.policy;
  if (policy.reduce_scatter_codec != CommCodec::kNone) {
    // As the quantized all-gather: blocks of each parameter's own, one message per peer.
    result.handle = quantized_reduce_scatter_coalesced(
        slots, parts, ReduceOp::kSum, reduction.group, policy.reduce_scatter_codec,
        policy.block_size, residuals, reduction.dropped_blocks);
    return;
  }
  result.handle =
      issue_coalesced(reduction.group, parts.front().device().type(), parts.size(), [&](size_t i) {
        return reduce_scatter(slots[i], parts[i], ReduceOp::kSum, reduction.group);
      });
}

// comm_fusion's reduce-scatter input: every gradient's input copied into its columns of
// one buffer, rank-major per bucket (padding between slots zeroed), and released as soon
// as it is copied, so that the fused input does not double the gradient memory of a
// reduction in flight.
at::Tensor take_inputs_fused(const std::vector<FSDPParam*>& params, std::vector<at::Tensor>& grads,
                             const std::vector<FusionBucket>& buckets,
                             const std::vector<int64_t>& widths, int64_t shards, bool keep_grads,
                             ReduceBufferStats& stats, ReduceScatterResult& result) {
  const at::Tensor input = at::empty({shards * result.buffer.numel()}, result.buffer.options());
  std::vector<at::Tensor> columns;  // per parameter, its [shards x padded_numel] part
  for (const FusionBucket& bucket : buckets) {
    for (at::Tensor& column : bucket_columns(input, bucket, shards, result.offsets, widths)) {
      columns.push_back(std::move(column));
    }
    zero_between_slots(bucket_rows(input, bucket, shards), bucket, result.offsets, widths);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const CommBuffer part = params[i]->reduce_scatter_input(grads[i], input.scalar_type());
    columns[i].copy_(part.tensor.view(columns[i].sizes()));
    release_copied_input(part, stats);
    if (keep_grads) result.grads.push_back(std::move(grads[i]));
    grads[i] = at::Tensor();
  }
  result.inputs.push_back({input, /*owned=*/true});
  return input;
}

// comm_fusion's reduce-scatter of `input` (rank-major per bucket, laid out like
// result.buffer) bucket after bucket, each into its part of the buffer. Each parameter
// keeps its own error-feedback residual, so that it does not depend on which parameters a
// reduction fuses: a bucket's residuals are copied into one fused residual before its
// quantizing call and back out after it (the call leaves in it what its codes did not carry).
void reduce_fused(const std::vector<FSDPParam*>& params, const at::Tensor& input,
                  const std::vector<FusionBucket>& buckets, const std::vector<int64_t>& widths,
                  const Reduction& reduction, ReduceScatterResult& result) {
  const int64_t shards = reduction.group.size();
  at::Tensor residual;
  if (reduction.policy.error_feedback) {
    residual = at::zeros_like(input, input.options().dtype(at::kFloat));
  }
  result.handle =
      issue_coalesced(reduction.group, input.device().type(), buckets.size(), [&](size_t b) {
        const FusionBucket& bucket = buckets[b];
        std::vector<at::Tensor> residual_parts;
        if (residual.defined()) {
          residual_parts = bucket_columns(residual, bucket, shards, result.offsets, widths);
          for (size_t i = 0; i < residual_parts.size(); ++i) {
            residual_parts[i].copy_(params[bucket.first + i]->residual_on(input.device()));
          }
        }
        const at::Tensor bucket_residual =
            residual.defined() ? bucket_rows(residual, bucket, shards).view(-1) : at::Tensor();
        const at::Tensor output = result.buffer.narrow(0, bucket.begin, bucket.end - bucket.begin);
        const at::Tensor rows = bucket_rows(input, bucket, shards).view(-1);
        CommHandle handle =
            reduction.policy.reduce_scatter_codec == CommCodec::kNone
                ? reduce_scatter(output, rows, ReduceOp::kSum, reduction.group)
                : quantized_reduce_scatter(output, rows, ReduceOp::kSum, reduction.group,
                                           reduction.policy.reduce_scatter_codec,
                                           reduction.policy.block_size, bucket_residual,
                                           reduction.dropped_blocks);
        for (size_t i = 0; i < residual_parts.size(); ++i) {
          params[bucket.first + i]->residual_on(input.device()).copy_(residual_parts[i]);
        }
        return handle;
      });
}

}  // namespace

int64_t WireFormat::bytes(int64_t count) const {
  return codec == CommCodec::kNone ? count * element_size : quantized_row_bytes(count, block_size);
}

std::vector<FusionBucket> fusion_buckets(const std::vector<int64_t>& offsets, int64_t total,
                                         int64_t bucket_bytes, const WireFormat& format) {
  const auto end_of = [&](size_t i) { return i + 1 < offsets.size() ? offsets[i + 1] : total; };
  std::vector<FusionBucket> buckets;
  size_t first = 0;
  for (size_t i = 1; i <= offsets.size(); ++i) {
    const bool full = i < offsets.size() && bucket_bytes > 0 &&
                      format.bytes(end_of(i) - offsets[first]) > bucket_bytes;
    if (i == offsets.size() || full) {
      buckets.push_back({first, i, offsets[first], end_of(i - 1)});
      first = i;
    }
  }
  return buckets;
}

AllGatherResult all_gather_params(const std::vector<FSDPParam*>& params,
                                  const std::vector<CommBuffer>& inputs, const Group& group,
                                  const CommFusion& fusion, const CommPolicy& policy) {
  c10::NoGradGuard no_grad;
  AllGatherResult result;
  for (const CommBuffer& input : inputs) {
    if (input.owned) result.temporaries.push_back(input.tensor);
  }
  if (fusion.enabled) {
    gather_fused(inputs, group, fusion, policy, result);
  } else {
    gather_each_parameter(params, inputs, group, policy, result);
  }
  return result;
}

void copy_out_all_gather(const std::vector<FSDPParam*>& params, AllGatherResult& result,
                         CommStreams& streams) {
  for (size_t i = 0; i < params.size(); ++i) params[i]->copy_out(result.outputs[i]);
  result.outputs.clear();
  std::vector<at::DataPtr> memory;
  for (const at::Tensor& buffer : result.temporaries) memory.push_back(take_storage(buffer));
  result.temporaries.clear();
  streams.release_after_compute(Lane::kAllGather, std::move(memory));
}

DivideFactors split_divide_factor(double factor, c10::ScalarType reduce_dtype) {
  if (reduce_dtype != at::kHalf || factor <= 1.0) return {1.0, factor};
  double before = 1.0;
  while (before * before < factor) before *= 2.0;
  return {before, factor / before};
}

ReduceScatterResult reduce_scatter_grads(const std::vector<FSDPParam*>& params,
                                         std::vector<at::Tensor> grads,
                                         c10::ScalarType reduce_dtype, const Group& group,
                                         double divide_before, const CommFusion& fusion,
                                         const CommPolicy& policy, const at::Tensor& dropped_blocks,
                                         bool keep_grads, ReduceBufferStats& stats) {
  c10::NoGradGuard no_grad;
  ReduceScatterResult result;
  const int64_t align = std::max<int64_t>(1, kSlotAlignmentBytes / c10::elementSize(reduce_dtype));
  std::vector<int64_t> widths;
  int64_t total = 0;
  for (FSDPParam* p : params) {
    result.offsets.push_back(total);
    widths.push_back(p->layout().padded_numel);
    total += (widths.back() + align - 1) / align * align;
  }
  result.buffer = at::empty({total}, grads.front().options().dtype(reduce_dtype));
  const Reduction reduction{group, policy, dropped_blocks};
  if (!fusion.enabled || !group.communicates()) {
    zero_between_slots(result.buffer.view({1, total}), {0, params.size(), 0, total}, result.offsets,
                       widths);
    const std::vector<at::Tensor> parts =
        take_inputs_each(params, grads, divide_before, keep_grads, result);
    reduce_each_parameter(params, parts, reduction, result);
    return result;
  }
  // Rank-major per bucket and laid out like the buffer, so that each bucket's
  // reduce-scatter lands in its part of the buffer as is.
  const std::vector<FusionBucket> buckets =
      fusion_buckets(result.offsets, total, fusion.bucket_bytes,
                     {static_cast<int64_t>(c10::elementSize(reduce_dtype)),
                      policy.reduce_scatter_codec, policy.block_size});
  const at::Tensor input =
      take_inputs_fused(params, grads, buckets, widths, group.size(), keep_grads, stats, result);
  if (divide_before != 1.0) input.div_(divide_before);
  reduce_fused(params, input, buckets, widths, reduction, result);
  return result;
}

void wait_issued(std::vector<CommHandle>& issued) noexcept {
  for (CommHandle& handle : issued) {
    try {
      handle.wait();
    } catch (...) {  // secondary to the error that led here
    }
  }
}

void release_reduce_inputs(ReduceScatterResult& result, ReduceBufferStats& stats) {
  for (const CommBuffer& input : result.inputs) release_copied_input(input, stats);
  result.inputs.clear();
  result.grads.clear();
}

void install_reduced_grads(const std::vector<FSDPParam*>& params, const at::Tensor& buffer,
                           const std::vector<int64_t>& offsets, bool partial) {
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor slot = buffer.narrow(0, offsets[i], params[i]->layout().padded_numel);
    params[i]->accumulate_sharded_grad(slot, partial);
  }
}

}  // namespace hp::detail
