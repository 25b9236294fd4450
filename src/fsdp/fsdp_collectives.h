#pragma once
// The data path of unshard and gradient reduction, as functions over a list of
// parameters (the shape of FSDP2's foreach_all_gather / foreach_reduce). They keep no
// state: FSDPParamGroup owns the state machine and the backward schedule and calls these.
// Device-neutral: each takes the process group it communicates over and returns the
// buffers it made plus one handle for the collectives in flight.

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm_streams.h"
#include "fsdp_param.h"
#include "hyperparallel/comm_handle.h"
#include "hyperparallel/policy.h"
#include "hyperparallel/process_group.h"

namespace hp::detail {

// What gradient reduction did with reduce-scatter inputs (the library frees only
// buffers it allocated). Read by tests.
struct ReduceBufferStats {
  int64_t freed_owned = 0;   // buffers this library allocated, freed after use
  int64_t kept_aliased = 0;  // views of the caller's gradient, left alone
};

// comm_fusion: a module's parameters in one buffer, moved by collectives that each send
// at most `bucket_bytes` to every peer (whole parameters, at least one each; 0: one
// collective for the module). Disabled: one collective per parameter.
struct CommFusion {
  bool enabled = false;
  int64_t bucket_bytes = 0;
};

// What `count` elements of `element_size` bytes send to each peer: themselves, or their
// codes and scales under a codec.
struct WireFormat {
  int64_t element_size = 4;
  CommCodec codec = CommCodec::kNone;
  int64_t block_size = 256;
  int64_t bytes(int64_t count) const;
};

// comm_fusion's collectives over a fused buffer of `total` elements in which parameter i
// starts at offsets[i]: runs of consecutive whole parameters, each sending at most
// `bucket_bytes` on the wire to every peer (0: one run), or one parameter alone if it is
// larger. Measured on the wire, so that a codec's smaller messages fill a bucket as well.
struct FusionBucket {
  size_t first = 0, last = 0;  // parameters [first, last)
  int64_t begin = 0, end = 0;  // elements
};
std::vector<FusionBucket> fusion_buckets(const std::vector<int64_t>& offsets, int64_t total,
                                         int64_t bucket_bytes, const WireFormat& format);

struct AllGatherResult {
  CommHandle handle;
  // Per parameter, its rank-major [shards x padded_numel] gathered data: the parameter's
  // own unsharded storage where the layout allows (per-parameter mode, Shard(0)), a
  // view of the one fused output buffer with comm_fusion.
  std::vector<at::Tensor> outputs;
  // Buffers allocated for this all-gather (inputs that are copies, fused and reordered
  // outputs), freed by copy-out: the backend may hold on to them a little longer.
  std::vector<at::Tensor> temporaries;
};

// All-gathers inputs[i] (parameter i's padded shard in param dtype, or the part it kept
// after forward) over `group`. Per-parameter mode issues one all-gather per parameter
// (one coalesced group where the backend has them: NCCL; Gloo runs them one by one),
// straight from the shard (no copy-in) into its unsharded storage for Shard(0) (no
// copy-out). comm_fusion copies the inputs into one buffer and issues one all-gather per
// bucket (each landing in place in the one output buffer).
// With policy.all_gather_codec each all-gather moves quantized blocks instead: per
// parameter, each shard quantized on its own and all of them in one collective; fused,
// each bucket quantized as one row.
AllGatherResult all_gather_params(const std::vector<FSDPParam*>& params,
                                  const std::vector<CommBuffer>& inputs, const Group& group,
                                  const CommFusion& fusion, const CommPolicy& policy);

// After result.handle completed: every parameter's unsharded tensor holds its whole
// value (copy-out where the all-gather did not land in place, on the compute stream);
// the temporaries are released to the all-gather lane once compute has read them.
void copy_out_all_gather(const std::vector<FSDPParam*>& params, AllGatherResult& result,
                         CommStreams& streams);

struct ReduceScatterResult {
  CommHandle handle;
  // This rank's reduced chunks, one 512-byte aligned slot per parameter (offsets): the
  // fused all-reduce input, and what the sharded gradients become views of.
  at::Tensor buffer;
  std::vector<int64_t> offsets;
  // Reduce-scatter inputs in use by the collectives, and with `keep_grads` the unsharded
  // gradients they were made from; released (release_reduce_inputs) once the handle
  // completed.
  std::vector<CommBuffer> inputs;
  std::vector<at::Tensor> grads;
};

// How a gradient division by `factor` is split around the reduction. fp16 sums overflow
// at scale (65504 is its largest value), so, as in FSDP2, the smallest power of two at
// least sqrt(factor) divides before and the rest after; other dtypes divide once, after.
struct DivideFactors {
  double before = 1.0;
  double after = 1.0;
};
DivideFactors split_divide_factor(double factor, c10::ScalarType reduce_dtype);

// Reduce-scatters grads[i] (parameter i's unsharded gradient) in `reduce_dtype` over
// `group`, summing, after dividing each input by `divide_before`. Per-parameter mode
// reduce-scatters each gradient into its slot (one coalesced group, as the all-gathers);
// comm_fusion lays all of them out in one input, rank-major per bucket (releasing each
// gradient's own input as soon as it is copied), and issues one reduce-scatter per
// bucket into its part of the buffer.
// `keep_grads`: the gradients stay referenced until the inputs are released, as a lane
// other than the one that made them reads them (CommStreams). With
// policy.reduce_scatter_codec each reduce-scatter moves quantized blocks instead (per
// parameter, all of a module's in one collective, as the all-gathers), and with
// policy.error_feedback carries each parameter's residual (FSDPParam::residual_on; the
// fused input carries its parameters' residuals, copied in and back out); `dropped_blocks`
// counts the blocks whose residual was dropped (quantized_collectives.h).
ReduceScatterResult reduce_scatter_grads(const std::vector<FSDPParam*>& params,
                                         std::vector<at::Tensor> grads,
                                         c10::ScalarType reduce_dtype, const Group& group,
                                         double divide_before, const CommFusion& fusion,
                                         const CommPolicy& policy, const at::Tensor& dropped_blocks,
                                         bool keep_grads, ReduceBufferStats& stats);

// Waits for every handle, ignoring their errors: called while another error propagates,
// before dropping buffers that collectives already issued still write into.
void wait_issued(std::vector<CommHandle>& issued) noexcept;

// Frees the inputs this library allocated (a view of the caller's gradient is only
// dropped), and drops the gradients kept with them.
void release_reduce_inputs(ReduceScatterResult& result, ReduceBufferStats& stats);

// Adds each parameter's slot of the reduced buffer to its sharded gradient (see
// FSDPParam::accumulate_sharded_grad: a view of the buffer when there is none yet).
void install_reduced_grads(const std::vector<FSDPParam*>& params, const at::Tensor& buffer,
                           const std::vector<int64_t>& offsets, bool partial);

}  // namespace hp::detail
