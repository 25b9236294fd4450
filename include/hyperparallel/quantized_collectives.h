#pragma once
// all_gather and reduce_scatter that move quantized blocks (comm_codec.h) instead of
// the values: one byte per value plus 4 bytes per block, against 4 for fp32 and 2 for
// bf16. The arithmetic is defined, so every rank gets the same values, and the same as
// quantize_blocks / dequantize_blocks done in one process on the whole tensors give. On a
// group of one rank nothing travels and nothing is quantized.

#include <ATen/core/Tensor.h>

#include <vector>

#include "hyperparallel/collectives.h"
#include "hyperparallel/comm_codec.h"

namespace hp {

// As all_gather: output (contiguous, group size x input numel, the input's dtype) <- the
// inputs of all ranks, each quantized as one row and dequantized again (this rank's
// own part too, so that all ranks hold the same values).
CommHandle quantized_all_gather(at::Tensor output, const at::Tensor& input, const Group& group,
                                CommCodec codec, int64_t block_size);

// As reduce_scatter with kSum or kAvg: each rank quantizes the chunk of its input meant
// for each peer (one row per peer), sends it by all-to-all, and the owner dequantizes
// the chunks it received and sums them in fp32, in group-rank order (deterministic).
// `residual` (optional: contiguous fp32 with the input's numel) is error feedback: it is
// added to the input before quantizing and then holds what the codes did not carry (the
// sum minus what they stand for), for the next call to send; over many calls the error
// of the summed outputs then stays that of one call instead of growing with their count.
// A block holding an inf or a NaN (whose codes come back as NaNs) cannot be carried: its
// residual is dropped, left zero, so that one non-finite gradient does not poison every
// later call; `dropped_blocks` (optional: an int64 scalar on the input's device) counts
// them, added to without waiting for the device.
CommHandle quantized_reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                                    const Group& group, CommCodec codec, int64_t block_size,
                                    const at::Tensor& residual = {},
                                    const at::Tensor& dropped_blocks = {});

// The same for several tensors in one collective, as `*_coalesced` in c10d: each input is
// quantized on its own (its blocks start at its first value), so each output holds what a
// call per tensor gives, bit for bit, and the bytes are the same; but they travel as one
// message per peer instead of one per tensor, which on a TCP link saves a round trip per
// tensor (fully_shard's per-parameter mode moves a module's parameters so when quantized).
// `residuals`: none, or one per input as `residual` above; `dropped_blocks` counts for all.
CommHandle quantized_all_gather_coalesced(std::vector<at::Tensor> outputs,
                                          const std::vector<at::Tensor>& inputs, const Group& group,
                                          CommCodec codec, int64_t block_size);
CommHandle quantized_reduce_scatter_coalesced(std::vector<at::Tensor> outputs,
                                              const std::vector<at::Tensor>& inputs, ReduceOp op,
                                              const Group& group, CommCodec codec,
                                              int64_t block_size,
                                              const std::vector<at::Tensor>& residuals = {},
                                              const at::Tensor& dropped_blocks = {});

}  // namespace hp
