#pragma once
// Which parameters are tensor-parallel slices: the layers of tensor_parallel.h declare
// theirs, and the features that need whole tensors (FSDPModule::full_tensor, full state
// dicts, clip_grad_norm_) put the slices together, or count them once per slice.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "hyperparallel/process_group.h"

namespace hp {

// A parameter split along `dim` over `group`: group rank r holds the r-th of
// group->size() equal parts.
struct TensorParallelPlacement {
  GroupPtr group;
  int64_t dim = 0;
};

// Declares `param` (a module's parameter, not a copy) to be its rank's slice; for
// tensor-parallel layers of your own. A group of one rank declares nothing. The
// declaration follows the parameter through set_data (module->to(), fully_shard) and
// ends with it.
void set_tensor_parallel_placement(const at::Tensor& param, TensorParallelPlacement placement);

// The split of `param`; nullopt when it was never declared (replicated over the
// tensor-parallel group, or no tensor parallelism at all).
std::optional<TensorParallelPlacement> tensor_parallel_placement(const at::Tensor& param);

// The whole tensor of a slice `local` (a collective over placement.group: every rank of
// it calls, with its own slice), a new tensor.
at::Tensor tensor_parallel_full_tensor(const at::Tensor& local,
                                       const TensorParallelPlacement& placement);

}  // namespace hp
