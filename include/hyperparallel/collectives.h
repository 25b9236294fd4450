#pragma once
// Stateless collectives over a Group. Every call is asynchronous and returns a
// CommHandle; tensors must stay alive and untouched until wait(). Group ranks (not
// global ranks) name peers. On a group of size 1 nothing is communicated: the result
// is produced locally and the handle is a no-op.
// Tensors are communicated on their device's backend (Gloo for CPU, NCCL for CUDA). On
// a GPU job without Gloo (WorldOptions::gloo_on_gpu unset) a CPU tensor goes through the
// group's GPU: copied there when issued and back into the caller's tensor by wait(),
// which blocks the host until the device ran it (keep hot paths on device tensors). A
// failure there is NCCL's: its watchdog ends the process after the World's timeout.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hyperparallel/comm_handle.h"
#include "hyperparallel/process_group.h"

namespace hp {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// "sum", "avg", "max", "min" (case-insensitive); throws naming the accepted values.
ReduceOp parse_reduce_op(const std::string& name);
std::string to_string(ReduceOp op);

// output (contiguous, numel = group size x input numel) <- inputs of all ranks in
// group-rank order, flat.
CommHandle all_gather(at::Tensor output, const at::Tensor& input, const Group& group);

// output (contiguous, numel = input numel / group size) <- this rank's chunk of the
// element-wise reduction of all inputs (flat, chunked in group-rank order).
// kAvg divides by the group size (Gloo's own AVG silently sums: it is not used). On
// Gloo it runs as an all-to-all plus a local reduction, half the traffic of Gloo's own.
CommHandle reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                          const Group& group);

// In place, any contiguous tensor.
CommHandle all_reduce(at::Tensor tensor, ReduceOp op, const Group& group);

// Exchanges dim-0 slices: input is split into input_splits rows per destination rank,
// output receives output_splits rows from each source rank. Empty splits mean equal.
CommHandle all_to_all(at::Tensor output, const at::Tensor& input, const Group& group,
                      std::vector<int64_t> output_splits = {},
                      std::vector<int64_t> input_splits = {});

CommHandle broadcast(at::Tensor tensor, int64_t src, const Group& group);
// Point to point, matched by (peer, tag) in order. `what` names the transfer in a failure's
// error (e.g. a pipeline's stage and microbatch), next to the peer's world rank.
CommHandle send(const at::Tensor& tensor, int64_t dst, const Group& group, int tag = 0,
                const std::string& what = "");
CommHandle recv(at::Tensor tensor, int64_t src, const Group& group, int tag = 0,
                const std::string& what = "");
CommHandle barrier(const Group& group);

// Bytes this rank sent in the collectives above since the process started (or the last
// reset_wire_bytes), counted when each is issued on a group of more than one rank (n),
// as the usual algorithms move them: an all-gather sends its input to n - 1 ranks (a
// ring forwards n - 1 chunks), a reduce-scatter and an all-to-all the (n - 1) / n of
// their input meant for others, an all-reduce 2 (n - 1) / n of its tensor (a ring:
// reduce-scatter then all-gather), a broadcast's root the tensor to n - 1 ranks, a send
// its tensor. Quantized collectives count as the all-gather and all-to-all of bytes they
// issue. Safe to read while other threads communicate.
struct WireBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t all_to_all = 0;
  int64_t broadcast = 0;
  int64_t send = 0;
  int64_t total() const {
    return all_gather + reduce_scatter + all_reduce + all_to_all + broadcast + send;
  }
};
WireBytes wire_bytes();
void reset_wire_bytes();

}  // namespace hp
