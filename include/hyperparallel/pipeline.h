#pragma once
// Pipeline parallelism: a model cut into stages, one stage per rank of a pipeline group.
// Microbatches flow forward through the stages and their gradients flow back, under the
// GPipe schedule (all forwards, then all backwards). Composes with fully_shard: a stage
// may be fully_shard-ed over the data-parallel ranks that run the same stage; its
// gradients are then reduced once per step, in the last microbatch's backward.
//
//   // 2 stages x 2 data-parallel ranks: mesh {pp: 2, dp_shard: 2}
//   hp::fully_shard(stage_module, {.mesh = mesh.slice({"dp_shard"})});
//   hp::GPipeSchedule schedule({.forward = [&](const at::Tensor& x) { return stage_module(x); },
//                               .group = mesh.group("pp"),
//                               .fsdp = stage_module.fsdp()},
//                              /*microbatches=*/4, loss_fn);
//   auto result = schedule.step(first ? input : at::Tensor(), last ? target : at::Tensor());

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <optional>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"

namespace hp {

struct PipelineStage {
  // This rank's part of the model: the input batch (first stage) or the activation from
  // the previous stage, to the activation for the next stage (or the model's output, on
  // the last stage). Activations are sent with their shape and dtype, so they may vary.
  std::function<at::Tensor(const at::Tensor&)> forward;
  // The pipeline group: stage s runs on group rank s.
  GroupPtr group;
  // Set when the stage is fully_shard-ed: gradients are reduced only in the last
  // microbatch's backward (the others accumulate unsharded).
  std::optional<FSDPModule> fsdp;
  // Where activations received from the previous stage are put (this rank's device).
  c10::Device device = c10::kCPU;
};

struct PipelineStepResult {
  // Last stage: the loss of the whole batch, the mean of the microbatches' losses.
  // Undefined on the other stages.
  at::Tensor loss;
  // The gradients at the stage boundaries, microbatches concatenated along dim 0: what
  // this stage received for its output (undefined on the last stage) and sent back for
  // its input (undefined on the first).
  at::Tensor output_grad;
  at::Tensor input_grad;
};

class GPipeSchedule {
 public:
  // loss_fn(output, target) of one microbatch, a mean over its samples (like
  // torch::mse_loss): the step's loss is the mean over microbatches, so gradients are
  // those of loss_fn over the whole batch.
  GPipeSchedule(PipelineStage stage, int64_t microbatches,
                std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_fn);

  // One forward and backward of a batch; gradients accumulate in the stages'
  // parameters. The first stage passes `input`, the last stage `target` (both split
  // into microbatches along dim 0, which the count must divide); other stages pass
  // undefined tensors. A collective over the pipeline group.
  PipelineStepResult step(const at::Tensor& input, const at::Tensor& target);

 private:
  PipelineStage stage_;
  int64_t microbatches_;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_fn_;
};

}  // namespace hp
