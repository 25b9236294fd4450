#pragma once
// Immutable policies given to fully_shard.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

#include "hyperparallel/comm_codec.h"

namespace hp {

struct MixedPrecisionPolicy {
  // dtype of the unsharded parameters used in forward/backward (all-gathered in it).
  std::optional<c10::ScalarType> param_dtype;
  // dtype gradients are reduced in; unset: the unsharded gradient's dtype (param_dtype).
  std::optional<c10::ScalarType> reduce_dtype;
  // floating-point forward outputs are cast to it; unset: left as computed.
  std::optional<c10::ScalarType> output_dtype;
  // cast floating-point forward inputs to param_dtype before the module's forward.
  bool cast_forward_inputs = true;
  // accumulate reduced gradients in an fp32 copy kept with the shard, which becomes
  // param.grad, whatever the parameter's own dtype.
  bool apply_grad_on_fp32_main_grad = false;
};

struct OffloadPolicy {
  // Keep sharded parameters, their gradients and so the optimizer state in host memory;
  // copy to the compute device for the all-gather.
  bool offload = false;
  // Pin the host copies (only where CUDA exists: pinning needs a CUDA context).
  bool pin_memory = true;
};

// What fully_shard's collectives move (comm_codec.h); off by default. A quantized
// all-gather sends each rank's shard as blocks of one-byte codes and dequantizes them into
// the unsharded parameter (param_dtype): forward and backward use the quantized weights,
// while the optimizer still steps the full-precision shard. A quantized reduce-scatter
// sends each peer its part of the gradient the same way (all-to-all) and sums what it
// receives in fp32, in rank order. Both hold per-parameter and with comm_fusion, and
// within the smaller group of an integer reshard_after_forward (whose backward
// all-gather quantizes again the values the forward one dequantized). HSDP's all-reduce
// across replicas is not quantized: a ring all-reduce would quantize again at every hop.
struct CommPolicy {
  CommCodec all_gather_codec = CommCodec::kNone;
  CommCodec reduce_scatter_codec = CommCodec::kNone;
  // Values per fp32 scale: 256 costs 4 bytes per 256 one-byte codes (1.6%).
  int64_t block_size = 256;
  // Error feedback for the quantized reduce-scatter (needs reduce_scatter_codec): what a
  // step's codes did not carry is kept per parameter (fp32, the unsharded gradient's size,
  // on each rank) and sent with the next step's gradient. Sharded checkpoints keep it, so
  // that a resumed run continues exactly (on the mesh it was saved from).
  bool error_feedback = false;
};

}  // namespace hp
