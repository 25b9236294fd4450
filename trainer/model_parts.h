#pragma once
// The model as a run holds it: this rank's parts of the decoder, fully_shard-ed as the
// layout asks. Without --pp one part, the whole decoder; with --pp this rank's pipeline
// stages (pipeline_stages.h). The run itself (train_decoder.cpp) sees only this interface:
// a step, evaluation and checkpoints are the same code for both.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "trainer/evaluation.h"
#include "trainer/parallel_layout.h"
#include "trainer/text_batches.h"
#include "trainer/train_options.h"

namespace hp::trainer {

struct ModelSize {
  int64_t params = 0;        // whole tensors, every parallel slice counted
  double active_params = 0;  // what one token runs through: top_k of each MoE layer's experts
};

// A step's gradients, clipped, before the optimizer's update.
struct StepResult {
  at::Tensor loss;          // this rank's
  at::Tensor balance_loss;  // the MoE layers' balancing loss, this rank's parts' (or none)
  double grad_norm = 0;     // of the whole gradients, before clipping
};

class ModelParts {
 public:
  virtual ~ModelParts() = default;

  // The whole model's size (every rank's parts together).
  const ModelSize& size() const { return size_; }
  // This rank's parameters (with --pp: its stages', the tied copy included).
  virtual std::vector<at::Tensor> parameters() = 0;
  // What checkpoints save from and load into: with --pp this rank's stages under the whole
  // decoder's names, so that a pipeline's checkpoints are the whole decoder's.
  virtual torch::nn::Module& saved() = 0;
  virtual torch::nn::Module& loaded() = 0;
  // Whether this rank holds the whole model (an --export loads only into it).
  virtual bool whole() const = 0;
  // Gives the parameters their initial values (a resumed run loads them instead).
  virtual void materialize() = 0;
  // One forward and backward of `batch` (gradients zeroed before), the gradients clipped
  // to --clip-grad over every rank's shards (without it, only their norm measured).
  virtual StepResult forward_backward(const Batch& batch) = 0;
  // Evaluating and sampling through the parts; valid while they live.
  virtual Evaluation evaluation() = 0;
  // Throws when copies of one weight that must stay equal differ (with --pp: the tied
  // embedding on the first and last stages). A collective.
  virtual void check_copies_equal(int64_t rank) = 0;

 protected:
  explicit ModelParts(ModelSize size) : size_(size) {}

 private:
  ModelSize size_;
};

// The options' decoder, recorded on every rank (deferred: no rank holds the whole model)
// and sharded: fully_shard-ed whole, or cut into this rank's stages with --pp (which
// materializes them). Throws UsageError for a model the options cannot make.
std::unique_ptr<ModelParts> make_model_parts(const TrainOptions& o, const ParallelLayout& layout);

// Elements of `params` as this rank holds them, or (`whole`) of the whole tensors of
// parallel slices.
int64_t numel_of(const std::vector<at::Tensor>& params, bool whole = false);

}  // namespace hp::trainer
