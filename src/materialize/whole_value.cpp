#include "whole_value.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "../deferred_init/deferred_init_engine.h"
#include "hyperparallel/deferred_init.h"

namespace hp::detail {

void set_whole_value(const at::Tensor& tensor, const at::Tensor& whole,
                     const ShardedParameter* shard) {
  c10::NoGradGuard no_grad;
  if (shard) {
    shard->set_full(whole);  // this rank's part into the local shard
  } else if (is_deferred(tensor)) {
    // The variable is still a meta tensor. set_data refuses meta -> real (incompatible
    // tensor types), so its TensorImpl takes over a copy's storage and metadata in place:
    // the variable object itself (module member, parameters(), optimizer state) and its
    // autograd fields (requires_grad) stay as they are. A copy, so that it never shares
    // memory with the caller's tensor.
    const at::Tensor value = whole.to(*deferred_device(tensor), tensor.scalar_type(),
                                      /*non_blocking=*/false, /*copy=*/true);
    tensor.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
  } else {
    tensor.copy_(whole);
  }
  mark_materialized(tensor);
}

void set_local_value(const at::Tensor& variable, const ShardedParameter& shard,
                     const at::Tensor& local) {
  shard.set_local(local);
  mark_materialized(variable);
}

}  // namespace hp::detail
