#pragma once
// Pipeline parallelism: a model cut into stages over the ranks of a pipeline group.
// Microbatches flow forward through the stages and their gradients flow back, in the order
// a schedule gives each rank:
//
//   GPipeSchedule                all forwards, then all backwards: a stage holds the
//                                activations of all M microbatches; the bubble (idle share
//                                of a step) is (S-1)/(M+S-1) for S stages
//   OneFOneBSchedule             S-1-r warm-up forwards on rank r, then one forward / one
//                                backward: a stage holds at most S microbatches' activations
//                                (same bubble as GPipe)
//   InterleavedOneFOneBSchedule  each rank holds V model chunks (virtual stages), chunk v of
//                                rank r being stage v*S + r of the V*S: the bubble shrinks
//                                to (S-1)/(V*M+S-1)
//
// Every schedule computes the same gradients in the same order of microbatches per stage,
// so their results are bitwise equal. Sends and receives are asynchronous: each action's
// receive is posted before the previous action computes, and sends complete while the
// next ones run. Composes with fully_shard: a stage (chunk) may be fully_shard-ed over the
// data-parallel ranks that run it; its gradients are reduced once per step, in that chunk's
// last backward (the others accumulate unsharded).
//
//   // 2 stages x 2 data-parallel ranks: mesh {pp: 2, dp_shard: 2}
//   hp::fully_shard(stage_module, {.mesh = mesh.slice({"dp_shard"})});
//   hp::OneFOneBSchedule schedule({.forward = [&](const at::Tensor& x) { return stage_module(x); },
//                                  .group = mesh.group("pp"),
//                                  .fsdp = stage_module.fsdp()},
//                                 /*microbatches=*/4, loss_fn);
//   auto result = schedule.step(first ? input : at::Tensor(), last ? target : at::Tensor());

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"

namespace hp {

struct PipelineStage {
  // This rank's part of the model (one chunk of it, under an interleaved schedule): the
  // input batch (first stage) or the activation from the previous stage, to the activation
  // for the next stage (or the model's output, on the last stage). Activations are sent
  // with their shape and dtype at a step's first microbatch; the others of the step must
  // have the same (equal microbatches of one batch do), so that their receives are posted
  // ahead.
  std::function<at::Tensor(const at::Tensor&)> forward;
  // The pipeline group, the same for all of a rank's chunks.
  GroupPtr group;
  // Set when the stage is fully_shard-ed: gradients are reduced only in its last
  // microbatch's backward (the others accumulate unsharded).
  std::optional<FSDPModule> fsdp;
  // Where activations received from the previous stage are put (this rank's device).
  c10::Device device = c10::kCPU;
  // Optional: a scalar loss of the chunk's own that its forward of a microbatch adds to
  // the model's (a mixture of experts' load balancing, say), read right after each
  // forward. It is backpropagated with that microbatch's backward, weighted 1/M like the
  // microbatch's loss: the step minimizes the mean over microbatches of the loss plus every
  // chunk's auxiliary loss. A zero without graph is allowed (no gradient to add); anything
  // but a scalar throws c10::ValueError in the middle of the step, so the other ranks wait
  // until their timeout, as for any error of a stage's forward.
  std::function<at::Tensor()> aux_loss;
};

struct PipelineStepResult {
  // On the rank with the last stage: the loss of the whole batch, the mean of the
  // microbatches' losses. Undefined on the others.
  at::Tensor loss;
  // On ranks with a chunk that has an aux_loss: the sum over those chunks of their
  // auxiliary losses' means over the microbatches (fp32, detached, on the chunks' device).
  // Undefined on the others.
  at::Tensor aux_loss;
  // Per chunk of this rank (one but for interleaved schedules), the gradients at its
  // boundaries, microbatches concatenated along dim 0: what it received for its output
  // (undefined at the last stage) and sent back for its input (undefined at the first).
  std::vector<at::Tensor> output_grads;
  std::vector<at::Tensor> input_grads;
};

// One step of a rank's schedule: a forward or backward of one microbatch through one of
// its chunks.
struct PipelineAction {
  enum Kind { kForward, kBackward };
  Kind kind;
  int64_t chunk;
  int64_t microbatch;
  bool operator==(const PipelineAction&) const = default;
};
// "F0.2" (forward of microbatch 2 through chunk 0), "B1.0", ...
std::string to_string(const PipelineAction& action);

class PipelineSchedule {
 public:
  // loss_fn(output, target) of one microbatch, a mean over its samples (like
  // torch::mse_loss): the step's loss is the mean over microbatches, so gradients are
  // those of loss_fn over the whole batch.
  using LossFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

  virtual ~PipelineSchedule() = default;

  // One forward and backward of a batch; gradients accumulate in the stages'
  // parameters. The rank of the first stage passes `input`, the rank of the last stage
  // `target` (both split into microbatches along dim 0, which the count must divide);
  // other ranks pass undefined tensors. A collective over the pipeline group.
  PipelineStepResult step(const at::Tensor& input, const at::Tensor& target);

  // This rank's actions of a step, in the order it runs them.
  const std::vector<PipelineAction>& actions() const { return actions_; }

 protected:
  // Checks the arguments (c10::ValueError naming the problem) and sets the actions from
  // `order(rank, ranks, chunks, microbatches)`.
  PipelineSchedule(
      std::vector<PipelineStage> chunks, int64_t microbatches, LossFn loss_fn,
      const std::function<std::vector<PipelineAction>(int64_t, int64_t, int64_t, int64_t)>& order);

 private:
  std::vector<PipelineStage> chunks_;
  int64_t microbatches_;
  LossFn loss_fn_;
  std::vector<PipelineAction> actions_;
};

class GPipeSchedule : public PipelineSchedule {
 public:
  GPipeSchedule(PipelineStage stage, int64_t microbatches, LossFn loss_fn);
};

class OneFOneBSchedule : public PipelineSchedule {
 public:
  OneFOneBSchedule(PipelineStage stage, int64_t microbatches, LossFn loss_fn);
};

// `chunks`: this rank's V >= 2 chunks, chunk v being stage v*S + rank. The microbatch
// count must be a multiple of S (microbatches go through the chunks in groups of S).
class InterleavedOneFOneBSchedule : public PipelineSchedule {
 public:
  InterleavedOneFOneBSchedule(std::vector<PipelineStage> chunks, int64_t microbatches,
                              LossFn loss_fn);
};

}  // namespace hp
