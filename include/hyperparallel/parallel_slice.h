#pragma once
// Parameters that are one rank's slice of a tensor split over a group: the layers of
// tensor parallelism (tensor_parallel.h) and the experts of expert parallelism
// (expert_parallel.h) declare theirs. What needs whole tensors puts the slices together
// (FSDPModule::full_tensor / full_grad, full and sharded checkpoints, optimizer state
// dicts) and clip_grad_norm_ counts every slice once; fully_shard refuses to shard a slice
// over ranks that hold other slices of it.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "hyperparallel/process_group.h"

namespace hp {

// A tensor split along `dim` over `group`: group rank r holds the r-th of group->size()
// equal parts.
struct ParallelSlice {
  GroupPtr group;
  int64_t dim = 0;
};

// Declares `param` (a module's parameter itself, not a copy) to be this rank's slice; for
// parallel layers of your own. A group of one rank declares nothing. The declaration
// follows the parameter through set_data (module->to(), fully_shard) and ends with it.
void declare_parallel_slice(const at::Tensor& param, ParallelSlice slice);

// The slice `param` was declared to be; nullopt when it was not (the same on every rank
// of the groups around it, or no such parallelism at all).
std::optional<ParallelSlice> parallel_slice_of(const at::Tensor& param);

// This rank's part of `whole` (a view): the slice `slice` describes for its group rank.
at::Tensor slice_of(const at::Tensor& whole, const ParallelSlice& slice);

// The whole tensor from this rank's `local` slice (a collective over slice.group: every
// rank of it calls, with its own slice), a new tensor.
at::Tensor join_parallel_slices(const at::Tensor& local, const ParallelSlice& slice);

}  // namespace hp
