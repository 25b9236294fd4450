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

// Issues the collectives `issue` makes over `group` as one coalesced group where the
// backend has them (NCCL: one group call, so that many small collectives cost one
// launch); Gloo has none and runs them one by one, and a one-rank group may have no backend.
// Returns what `issue` returned, plus the group's own work. A failure while issuing ends
// the group before it propagates.
template <typename Issue>
CommHandle coalesced(const Group& group, c10::DeviceType device, Issue&& issue) {
  if (!group.communicates() || !GroupAccess::backend(group, device).supportsCoalescing()) {
    return CommHandle::after(issue(), {});
  }
  c10d::Backend* backend = &GroupAccess::backend(group, device);
  backend->startCoalescing();
  std::vector<CommHandle> parts;
  try {
    parts = issue();
  } catch (...) {
    try {
      CommHandle::from_work(backend->endCoalescing()).wait();
    } catch (...) {  // secondary to the error that led here
    }
    throw;
  }
  parts.push_back(
      CommHandle::from_work(backend->endCoalescing(), {},
                            GroupAccess::on_failure(group, "coalesced collectives", *backend)));
  return CommHandle::after(std::move(parts), {});
}

// The all-gather or reduce-scatter the policy asks for.
CommHandle gather(const at::Tensor& output, const at::Tensor& input, const Group& group,
                  const CommPolicy& policy) {
  if (policy.all_gather_codec == CommCodec::kNone) return all_gather(output, input, group);
  return quantized_all_gather(output, input, group, policy.all_gather_codec, policy.block_size);
}

CommHandle scatter(const at::Tensor& output, const at::Tensor& input, const Group& group,
                   const CommPolicy& policy, const at::Tensor& residual,
                   const at::Tensor& dropped_blocks) {
  if (policy.reduce_scatter_codec == CommCodec::kNone) {
    return reduce_scatter(output, input, ReduceOp::kSum, group);
  }
  return quantized_reduce_scatter(output, input, ReduceOp::kSum, group, policy.reduce_scatter_codec,
                                  policy.block_size, residual, dropped_blocks);
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
  const int64_t shards = group.size();
  const c10::DeviceType device = inputs.front().tensor.device().type();
  if (!fusion.enabled) {
    for (FSDPParam* param : params) {
      result.outputs.push_back(param->all_gather_output());
      if (!param->gathers_in_place()) result.temporaries.push_back(result.outputs.back());
    }
    if (policy.all_gather_codec != CommCodec::kNone) {
      // Quantized, each parameter still has blocks of its own, but they travel together:
      // one small message per parameter would cost a round trip each on a TCP link.
      std::vector<at::Tensor> shards;
      for (const CommBuffer& input : inputs) shards.push_back(input.tensor);
      result.handle = quantized_all_gather_coalesced(result.outputs, shards, group,
                                                     policy.all_gather_codec, policy.block_size);
      return result;
    }
    result.handle = coalesced(group, device, [&] {
      std::vector<CommHandle> gathers;
      try {
        for (size_t i = 0; i < params.size(); ++i) {
          gathers.push_back(all_gather(result.outputs[i], inputs[i].tensor, group));
        }
      } catch (...) {
        wait_issued(gathers);
        throw;
      }
      return gathers;
    });
    return result;
  }
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const CommBuffer& input : inputs) {
    offsets.push_back(total);
    total += input.tensor.numel();
  }
  at::Tensor input = at::empty({total}, inputs.front().tensor.options());
  for (size_t i = 0; i < inputs.size(); ++i) {
    input.narrow(0, offsets[i], inputs[i].tensor.numel()).copy_(inputs[i].tensor);
  }
  // Bucket after bucket, each rank-major: every bucket's all-gather lands in place.
  at::Tensor output = at::empty({shards * total}, input.options());
  const std::vector<FusionBucket> buckets =
      fusion_buckets(offsets, total, fusion.bucket_bytes,
                     {input.element_size(), policy.all_gather_codec, policy.block_size});
  for (const FusionBucket& bucket : buckets) {
    const at::Tensor rows = bucket_rows(output, bucket, shards);
    for (size_t i = bucket.first; i < bucket.last; ++i) {
      result.outputs.push_back(rows.narrow(1, offsets[i] - bucket.begin, inputs[i].tensor.numel()));
    }
  }
  result.temporaries.push_back(input);
  result.temporaries.push_back(output);
  result.handle = coalesced(group, device, [&] {
    std::vector<CommHandle> gathers;
    try {
      for (const FusionBucket& bucket : buckets) {
        gathers.push_back(gather(bucket_rows(output, bucket, shards).view(-1),
                                 input.narrow(0, bucket.begin, bucket.end - bucket.begin), group,
                                 policy));
      }
    } catch (...) {
      wait_issued(gathers);
      throw;
    }
    return gathers;
  });
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
                                         const CommPolicy& policy, const ResidualOf& residual_of,
                                         const at::Tensor& dropped_blocks, bool keep_grads,
                                         ReduceBufferStats& stats) {
  c10::NoGradGuard no_grad;
  ReduceScatterResult result;
  const int64_t align = std::max<int64_t>(1, kSlotAlignmentBytes / c10::elementSize(reduce_dtype));
  int64_t total = 0;
  for (FSDPParam* p : params) {
    result.offsets.push_back(total);
    total += (p->layout().padded_numel + align - 1) / align * align;
  }
  const at::TensorOptions options = grads.front().options().dtype(reduce_dtype);
  result.buffer = at::empty({total}, options);
  const int64_t shards = group.size();
  if (fusion.enabled && group.communicates()) {
    // Rank-major per bucket and laid out like the buffer, so that each bucket's
    // reduce-scatter lands in its part of the buffer as is.
    const std::vector<FusionBucket> buckets =
        fusion_buckets(result.offsets, total, fusion.bucket_bytes,
                       {static_cast<int64_t>(c10::elementSize(reduce_dtype)),
                        policy.reduce_scatter_codec, policy.block_size});
    at::Tensor input = at::empty({shards * total}, options);
    std::vector<at::Tensor> columns;  // per parameter, its [shards x padded_numel] part
    for (const FusionBucket& bucket : buckets) {
      const at::Tensor rows = bucket_rows(input, bucket, shards);
      std::vector<int64_t> offsets;
      for (size_t i = bucket.first; i < bucket.last; ++i) {
        offsets.push_back(result.offsets[i] - bucket.begin);
        columns.push_back(rows.narrow(1, offsets.back(), params[i]->layout().padded_numel));
      }
      zero_between_slots(rows, offsets,
                         {params.begin() + bucket.first, params.begin() + bucket.last});
    }
    for (size_t i = 0; i < params.size(); ++i) {
      std::vector<CommBuffer> part = {params[i]->reduce_scatter_input(grads[i], reduce_dtype)};
      columns[i].copy_(part.front().tensor.view(columns[i].sizes()));
      // Copied: released now rather than after the collective, so that the fused
      // input does not double the gradient memory of a reduction in flight.
      release_copied_input(part.front(), stats);
      if (keep_grads) result.grads.push_back(std::move(grads[i]));
      grads[i] = at::Tensor();
    }
    if (divide_before != 1.0) input.div_(divide_before);
    result.inputs.push_back({input, /*owned=*/true});
    // Each parameter keeps its own error-feedback residual, so that it does not depend on
    // which parameters a reduction fuses (and checkpoints hold it per parameter).
    at::Tensor residual;
    std::vector<at::Tensor> residuals;
    if (policy.error_feedback) {
      residual = at::zeros({shards * total}, options.dtype(at::kFloat));
      for (size_t i = 0; i < params.size(); ++i) {
        residuals.push_back(residual_of(*params[i], input.device()));
      }
    }
    const auto residual_columns = [&](const FusionBucket& bucket) {
      std::vector<at::Tensor> parts;
      const at::Tensor rows = bucket_rows(residual, bucket, shards);
      for (size_t i = bucket.first; i < bucket.last; ++i) {
        parts.push_back(
            rows.narrow(1, result.offsets[i] - bucket.begin, params[i]->layout().padded_numel));
      }
      return parts;
    };
    result.handle = coalesced(group, options.device().type(), [&] {
      std::vector<CommHandle> reduce_scatters;
      try {
        for (const FusionBucket& bucket : buckets) {
          at::Tensor bucket_residual;
          if (residual.defined()) {
            const std::vector<at::Tensor> parts = residual_columns(bucket);
            for (size_t i = bucket.first; i < bucket.last; ++i) {
              parts[i - bucket.first].copy_(residuals[i]);
            }
            bucket_residual = bucket_rows(residual, bucket, shards).view(-1);
          }
          reduce_scatters.push_back(
              scatter(result.buffer.narrow(0, bucket.begin, bucket.end - bucket.begin),
                      bucket_rows(input, bucket, shards).view(-1), group, policy, bucket_residual,
                      dropped_blocks));
          if (residual.defined()) {  // the quantizing call left what its codes did not carry
            const std::vector<at::Tensor> parts = residual_columns(bucket);
            for (size_t i = bucket.first; i < bucket.last; ++i) {
              residuals[i].copy_(parts[i - bucket.first]);
            }
          }
        }
      } catch (...) {
        wait_issued(reduce_scatters);
        throw;
      }
      return reduce_scatters;
    });
    return result;
  }
  zero_between_slots(result.buffer, result.offsets, params);
  std::vector<at::Tensor> slots, parts, residuals;
  for (size_t i = 0; i < params.size(); ++i) {
    CommBuffer part = params[i]->reduce_scatter_input(grads[i], reduce_dtype);
    // In place: the input is this reduction's own (a copy, or the unsharded gradient
    // that is dropped once reduced).
    if (divide_before != 1.0) part.tensor.div_(divide_before);
    if (keep_grads) result.grads.push_back(std::move(grads[i]));
    grads[i] = at::Tensor();
    slots.push_back(result.buffer.narrow(0, result.offsets[i], params[i]->layout().padded_numel));
    if (policy.error_feedback) {
      residuals.push_back(residual_of(*params[i], part.tensor.device()).view(-1));
    }
    parts.push_back(part.tensor);
    result.inputs.push_back(std::move(part));
  }
  if (policy.reduce_scatter_codec != CommCodec::kNone) {
    // As the quantized all-gather: blocks of each parameter's own, one message per peer.
    result.handle = quantized_reduce_scatter_coalesced(
        slots, parts, ReduceOp::kSum, group, policy.reduce_scatter_codec, policy.block_size,
        residuals, dropped_blocks);
    return result;
  }
  result.handle = coalesced(group, options.device().type(), [&] {
    std::vector<CommHandle> reduce_scatters;
    try {
      for (size_t i = 0; i < params.size(); ++i) {
        reduce_scatters.push_back(reduce_scatter(slots[i], parts[i], ReduceOp::kSum, group));
      }
    } catch (...) {
      wait_issued(reduce_scatters);
      throw;
    }
    return reduce_scatters;
  });
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
