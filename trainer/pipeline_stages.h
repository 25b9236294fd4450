#pragma once
// The decoder cut into pipeline stages (--pp): stage s of N = pp x virtual-stages holds
// layers [s L/N, (s+1) L/N); stage 0 also the token and position embeddings, the last stage
// the final norm and the output projection. Chunk v of pipeline rank r is stage v pp + r.
// Each stage is fully_shard-ed over its data-parallel ranks; with tensor parallelism its
// blocks and the vocabulary are split over the tensor-parallel ranks, and its MoE layers' experts
// over the expert-parallel ones, as in the whole decoder. A stage's MoE balancing loss of a
// microbatch goes backward with that microbatch (PipelineStage::aux_loss).
//
// The output projection is tied to the token embedding, which lives on stage 0: the last
// stage holds its own copy, equal at the start (both ranks materialize the same recorded
// tensor). After every backward the two copies' gradients are summed over the pair
// {stage 0's rank, the last stage's rank} of each data-parallel and tensor-parallel position
// (Megatron's embedding group), so both take the same update and stay bitwise equal.

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/pipeline.h"
#include "models/transformer.h"
#include "trainer/parallel_layout.h"
#include "trainer/text_batches.h"
#include "trainer/train_options.h"

namespace hp::trainer {

// The trainer's loss: the mean cross-entropy of `logits` [B, T, vocab] (tensor-parallel:
// this rank's vocabulary slice) against the next bytes `target` [B, T].
at::Tensor next_byte_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                   const GroupPtr& tensor_parallel);

// One stage: a module of modules taken from the whole decoder.
struct DecoderStageImpl : torch::nn::Module {
  DecoderStageImpl(models::Transformer& whole, int64_t stage, int64_t stages);
  // Tokens [B, T] (stage 0) or hidden states [B, T, dim], to hidden states or (last stage)
  // logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& x);

  bool first, last;
  models::Transformer whole;  // for its recompute_layers
  at::Tensor aux_loss;        // the MoE layers' balancing losses of the last forward, summed
  std::vector<Sharded<models::DecoderBlock>> layers;
  std::vector<int64_t> layer_indices;
};
TORCH_MODULE(DecoderStage);

class DecoderPipeline {
 public:
  // Takes this rank's stages out of `whole` (deferred, recorded alike on every rank),
  // fully_shards each block and each stage with `options` and materializes them.
  DecoderPipeline(models::Transformer& whole, const TrainOptions& o, const ParallelLayout& layout,
                  const FullyShardOptions& options);

  // This rank's parameters, the tied copy included.
  std::vector<at::Tensor> parameters();

  // What one forward and backward gives every rank of the pipeline: the batch's mean loss
  // and, when the MoE layers add a balancing loss, that loss summed over the stages (the
  // mean over the microbatches; undefined otherwise).
  struct Losses {
    at::Tensor loss, balance_loss;
  };
  // One forward and backward of `batch` by the schedule, the tied copies' gradients summed.
  Losses forward_backward(const Batch& batch);

  // The gradients' global norm over all stages (the tied weight counted once), every rank
  // scaling its gradients by max_norm / (norm + 1e-6) when that is below 1. Returns it.
  double clip_grad_norm(double max_norm);

  // Forward only, without autograd: the logits of `tokens` [B, T] on the last stage's rank
  // (undefined on the others). Every rank of the pipeline calls it.
  at::Tensor logits(const at::Tensor& tokens);
  bool holds_last_stage() const { return rank_ == pp_ - 1; }

  // Whether both copies of the tied weight are bitwise equal on every data-parallel
  // position: a collective over all ranks of the world.
  bool tied_copies_equal();

  // This rank's stages under the whole decoder's names (a block by its index in it), so
  // that the sharded checkpoints of a pipeline are the whole decoder's: what this rank
  // saves (the last stage leaves the tied weight to stage 0, which saves it) and what it
  // loads (the last stage's copy included, so both copies load the same values).
  torch::nn::Module& saved_part() { return *saved_part_; }
  torch::nn::Module& loaded_part() { return *loaded_part_; }

 private:
  at::Tensor tied_weight();  // this rank's copy; undefined on middle stages

  int64_t pp_, rank_;
  bool balances_experts_;  // the stages add their MoE layers' balancing losses
  ParallelLayout layout_;
  std::vector<Sharded<DecoderStage>> chunks_;
  GroupPtr embedding_group_;  // null on middle stages
  std::unique_ptr<PipelineSchedule> schedule_;
  std::shared_ptr<torch::nn::Module> saved_part_, loaded_part_;
};

}  // namespace hp::trainer
