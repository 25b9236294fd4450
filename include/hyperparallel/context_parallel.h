#pragma once
// Context parallelism: the sequence of each sample is split over the ranks of a
// context-parallel group. Every layer but attention works token by token, so it runs on
// the local part unchanged; attention gathers the keys and values of the whole sequence
// and attends this rank's queries to them under a causal mask of global positions.
//
//   hp::ContextParallelOptions cp_options;                      // load-balanced by default
//   at::Tensor local_tokens = hp::shard_sequence(tokens, cp_group, cp_options);
//   at::Tensor positions = hp::sequence_positions(tokens.size(1), cp_group, cp_options);
//   ...
//   at::Tensor out = hp::context_parallel_attention(q, k, v, cp_group, cp_options);
//
// The model's parameters are replicated over the group: each rank's gradient is that of
// its local loss, and summing (or averaging, with equal token counts) over the
// context-parallel ranks gives the gradient of the whole sequence's loss. With
// fully_shard, shard over a mesh that spans data-parallel x context-parallel ranks.
//
// On a group of size 1 nothing is communicated and every function is the identity (or
// plain causal attention).

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>

#include "hyperparallel/process_group.h"

namespace hp {

// How the global sequence is cut over cp ranks.
enum class SequenceLayout {
  // Rank r holds the r-th of cp equal chunks. Under a causal mask the last rank attends
  // to cp times more keys than the first.
  kContiguous,
  // The sequence is cut into 2 x cp chunks and rank r holds chunks r and 2 x cp - 1 - r
  // (in that order), so that every rank does the same causal work (as torchtitan and
  // Megatron-LM do).
  kLoadBalanced,
};

struct ContextParallelOptions {
  SequenceLayout layout = SequenceLayout::kLoadBalanced;
};

// This rank's part of `global` along `seq_dim` (e.g. tokens [B, T] or hidden states
// [B, T, D]). The length must be divisible by the group size (kContiguous) or by twice
// the group size (kLoadBalanced).
at::Tensor shard_sequence(const at::Tensor& global, const GroupPtr& group,
                          const ContextParallelOptions& options = {}, int64_t seq_dim = 1);

// The global positions (int64) of this rank's tokens, in the order shard_sequence puts
// them, for a sequence of `seq_len` tokens: what position embeddings and masks need.
at::Tensor sequence_positions(int64_t seq_len, const GroupPtr& group,
                              const ContextParallelOptions& options = {},
                              const at::TensorOptions& tensor_options = at::kLong);

// The inverse of shard_sequence: every rank's part, gathered and put back in global
// order (a collective: call on every rank of the group). Differentiable: the gradient
// of each rank's result flows back to the rank that holds each part, summed.
at::Tensor unshard_sequence(const at::Tensor& local, const GroupPtr& group,
                            const ContextParallelOptions& options = {}, int64_t seq_dim = 1);

// Every rank's `local` concatenated along `dim` in group-rank order (a collective).
// Differentiable: backward reduce-scatters the gradient (summed over the ranks) back to
// each rank's part. All ranks' `local` must have the same shape. On a group of size 1 it
// returns `local` itself.
at::Tensor gather_along_dim(const at::Tensor& local, int64_t dim, const GroupPtr& group);

// Causal attention of this rank's queries to the keys and values of the whole sequence.
// q, k, v: [B, H, T_local, head_dim], this rank's part (shard_sequence with `options`).
// Gathers k and v over the group (one all-gather; one reduce-scatter of their gradients
// in backward), masks by global positions (a query sees the keys at its own position
// and before) and takes the softmax in fp32. Returns [B, H, T_local, head_dim].
at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const GroupPtr& group,
                                      const ContextParallelOptions& options = {});

}  // namespace hp
