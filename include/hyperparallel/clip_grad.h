#pragma once
// Gradient clipping by the global norm of a model whose parameters fully_shard holds as
// shards: the norm is that of the whole gradients, as torch::nn::utils::clip_grad_norm_
// computes it for the unsharded model on one process, and every rank scales its part by
// the same factor.

#include <ATen/core/Tensor.h>

#include <vector>

namespace hp {

// `parameters`: typically model->parameters(), on every rank in the same order (the
// norm is a collective over the shard groups). Call after backward, before the
// optimizer step. Per kind of parameter:
// - sharded by fully_shard: this rank's shard of the gradient, summed over the shard
//   group (replicas of an HSDP mesh hold equal shards and are counted once; with
//   set_requires_all_reduce(false) they differ, and each replica uses its own norm);
// - replicated by fully_shard (replicate_params, Replicate()): the whole gradient, equal
//   on every rank, counted once;
// - not managed by fully_shard (plain or ignored parameters): this rank's gradient,
//   taken to be equal on every rank like a replicated one (as PyTorch does for plain
//   tensors).
// A parallel slice (parallel_slice.h: tensor-parallel layers, experts) is summed over its
// slice group on top; parameters that are not slices are the same on every rank of that
// group and counted once.
// norm_type: p > 0, or infinity for the max norm. Scales the gradients in place by
// max_norm / (norm + 1e-6) when that is below 1 and returns the norm before clipping.
// error_if_nonfinite: throw instead of scaling when the norm is NaN or infinite.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

// The same without reading the norm on the host, so without waiting for the device (for a
// GPU training loop that does not look at the norm every step): returns the norm as a
// 0-dim double tensor on the gradients' device and multiplies every gradient by
// min(1, max_norm / (norm + 1e-6)) computed there (a NaN norm makes them NaN, an infinite
// one zeroes them). The gradients end as clip_grad_norm_ leaves them.
at::Tensor clip_grad_norm_on_device_(const std::vector<at::Tensor>& parameters, double max_norm,
                                     double norm_type = 2.0);

}  // namespace hp
