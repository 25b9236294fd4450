#pragma once
// The parameters of a plain model as the training features built on fully_shard see them
// (state dicts, checkpoints, materialize): each with its fully_shard view and its
// parallel slice, if any.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/sharded_parameter.h"

namespace hp::detail {

struct ModelParam {
  std::string name;  // as in model.named_parameters()
  at::Tensor variable;
  std::optional<ShardedParameter> shard;  // unset: not sharded over data-parallel ranks
  // Set: this rank holds a slice (parallel_slice.h); the whole tensor joins the slices.
  std::optional<ParallelSlice> parallel_slice;
  std::vector<int64_t> whole_shape;  // of the whole tensor (all shards, all slices)
};

// The whole tensor of `p` from `slice`, the parallel slice this rank holds (all
// ranks of the slice's group join): `slice` itself when `p` is not a slice.
at::Tensor whole_of(const ModelParam& p, const at::Tensor& slice);
// This rank's parallel slice of `whole`: `whole` itself when `p` is not a slice.
at::Tensor slice_of_whole(const ModelParam& p, const at::Tensor& whole);

// The parameters of `model`, in its order.
std::vector<ModelParam> model_params(torch::nn::Module& model);

// Whether this process writes the files of `model`'s whole tensors: the first of the
// data-parallel ranks its fully_shard calls span (so each pipeline stage writes its own),
// and the first of the ranks holding its parallel slices. A model neither fully_shard nor
// a parallel slice spans is written by every process that asks.
bool writes_whole_tensors(torch::nn::Module& model);

// Throws c10::Error naming `caller` when the parameter holds unsharded data now.
void require_sharded(const ShardedParameter& p, const std::string& name, const char* caller);

}  // namespace hp::detail
