#pragma once
// Tensor parallelism (Megatron-LM's layers) over a tensor-parallel Group:
//
//   ColumnParallelLinear  weight [out / tp, in]: each rank computes its slice of the
//                         outputs (e.g. its attention heads, its FFN hidden units).
//   RowParallelLinear     weight [out, in / tp]: each rank reduces its slice of the inputs;
//                         the partial outputs are summed over the group.
//   VocabParallelEmbedding weight [vocab / tp, dim]: each rank looks up its rows.
//   vocab_parallel_cross_entropy: the loss of logits split over the vocabulary.
//
// Column then row is one all-reduce forward and one backward (the conjugate pair
// copy_to_tensor_parallel / reduce_from_tensor_parallel). With no group, or a group of
// one rank, every layer is exactly its plain LibTorch counterpart (same parameters, same
// random draws, same results bit for bit), so one model class is also the
// single-process reference.
//
// Parameters are built whole from the global generator (as torch::nn::Linear /
// Embedding draw them) and each rank keeps its slice: with the same seed, the slices
// of all ranks put together are the single-process model's parameters.
//
// fully_shard composes: shard a tensor-parallel module over the data-parallel dims of
// the mesh (e.g. mesh.slice({"dp_shard"})); each rank's shard is then a slice of its
// tensor-parallel slice (a 2-D placement). Full state dicts, clip_grad_norm_ and
// FSDPModule::full_tensor account for the tensor-parallel split; parameters the
// layers do not split (norms, RowParallelLinear's bias) are replicated over the group.
// Each layer declares its slices (parallel_slice.h).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/process_group.h"

namespace hp {

// Forward: x unchanged. Backward: the gradient summed over the group (x feeds every
// rank's slice of the computation).
at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const GroupPtr& group);
// Forward: x summed over the group. Backward: the gradient unchanged (what follows is
// replicated: every rank computes the same loss from the sum).
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const GroupPtr& group);
// Forward: the ranks' x concatenated along the last dim. Backward: this rank's slice.
at::Tensor gather_from_tensor_parallel(const at::Tensor& x, const GroupPtr& group);

struct ColumnParallelLinearOptions {
  int64_t in_features;
  int64_t out_features;  // divisible by the group size
  bool bias = true;
  // false: the output is this rank's slice [.., out / tp] (feeds a RowParallelLinear).
  // true: it is all-gathered to the whole [.., out].
  bool gather_output = false;
};

struct RowParallelLinearOptions {
  int64_t in_features;  // divisible by the group size
  int64_t out_features;
  bool bias = true;
  // true: the input is already this rank's slice [.., in / tp] (a ColumnParallelLinear's
  // output). false: it is the whole [.., in] and each rank takes its slice.
  bool input_is_parallel = true;
};

// What both tensor-parallel linears hold: torch::nn::Linear's parameters, drawn whole as
// it draws them, with the weight split over the group along one dim.
class ParallelLinearImpl : public torch::nn::Module {
 public:
  GroupPtr group;     // null: not parallel
  at::Tensor weight;  // column: [out / tp, in]; row: [out, in / tp]
  at::Tensor bias;    // column: [out / tp]; row: [out], replicated; undefined without one

 protected:
  // split_dim 0 splits the outputs (weight and bias), 1 the inputs (the weight only).
  ParallelLinearImpl(const char* layer_name, int64_t in_features, int64_t out_features,
                     bool with_bias, int64_t split_dim, GroupPtr group);
};

class ColumnParallelLinearImpl : public ParallelLinearImpl {
 public:
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options, GroupPtr group = nullptr);
  at::Tensor forward(const at::Tensor& x);
  ColumnParallelLinearOptions options;
};

// The bias is added once, after the sum over the group.
class RowParallelLinearImpl : public ParallelLinearImpl {
 public:
  RowParallelLinearImpl(RowParallelLinearOptions options, GroupPtr group = nullptr);
  at::Tensor forward(const at::Tensor& x);
  RowParallelLinearOptions options;
};

TORCH_MODULE(ColumnParallelLinear);
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  // vocab divisible by the group size.
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, GroupPtr group = nullptr);
  // tokens: int64 ids of the whole vocabulary. Returns [..., dim], replicated.
  at::Tensor forward(const at::Tensor& tokens);
  // This rank's rows: token ids [vocab_begin, vocab_begin + vocab / tp).
  int64_t vocab_begin() const;

  int64_t vocab, dim;
  GroupPtr group;
  at::Tensor weight;  // [vocab / tp, dim]
};
TORCH_MODULE(VocabParallelEmbedding);

// Mean cross-entropy of `logits` [N, vocab / tp] (this rank's vocabulary slice, in group-rank
// order, as a VocabParallelEmbedding's rows) against `target` [N] (ids of the whole
// vocabulary), without gathering the logits: max, sum of exponentials and the target's
// logit are reduced over the group. Computed in fp32; the same value on every rank. With
// no group: torch's cross_entropy.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const GroupPtr& group);

}  // namespace hp
