#pragma once
// Immutable policies given to fully_shard.

#include <c10/core/ScalarType.h>

#include <optional>

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

}  // namespace hp
