#include "hyperparallel/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "hyperparallel/collectives.h"

namespace hp {
namespace {

// An activation's shape and dtype travel ahead of it: [ndim, dims..., dtype].
constexpr int64_t kMaxDims = 8;

void send_activation(const at::Tensor& activation, int64_t dst, const Group& group) {
  if (activation.dim() > kMaxDims) {
    C10_THROW_ERROR(ValueError, "pipeline: activations have at most " + std::to_string(kMaxDims) +
                                    " dims, got " + std::to_string(activation.dim()));
  }
  at::Tensor meta = at::zeros({kMaxDims + 2}, at::kLong);
  meta[0] = activation.dim();
  for (int64_t d = 0; d < activation.dim(); ++d) meta[d + 1] = activation.size(d);
  meta[kMaxDims + 1] = static_cast<int64_t>(activation.scalar_type());
  send(meta, dst, group).wait();
  send(activation.contiguous(), dst, group).wait();
}

at::Tensor recv_activation(int64_t src, const Group& group, const at::TensorOptions& device) {
  at::Tensor meta = at::empty({kMaxDims + 2}, at::kLong);
  recv(meta, src, group).wait();
  std::vector<int64_t> shape(meta[0].item<int64_t>());
  for (size_t d = 0; d < shape.size(); ++d) shape[d] = meta[d + 1].item<int64_t>();
  const auto dtype = static_cast<c10::ScalarType>(meta[kMaxDims + 1].item<int64_t>());
  at::Tensor activation = at::empty(shape, device.dtype(dtype));
  recv(activation, src, group).wait();
  return activation;
}

std::vector<at::Tensor> split_batch(const at::Tensor& batch, int64_t microbatches,
                                    const char* what) {
  if (batch.size(0) % microbatches != 0) {
    C10_THROW_ERROR(ValueError, std::string("pipeline: the ") + what + " batch of " +
                                    std::to_string(batch.size(0)) + " is not divisible into " +
                                    std::to_string(microbatches) + " microbatches");
  }
  return batch.chunk(microbatches, 0);
}

}  // namespace

GPipeSchedule::GPipeSchedule(
    PipelineStage stage, int64_t microbatches,
    std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_fn)
    : stage_(std::move(stage)), microbatches_(microbatches), loss_fn_(std::move(loss_fn)) {
  if (!stage_.forward) C10_THROW_ERROR(ValueError, "pipeline: the stage has no forward");
  if (!stage_.group) C10_THROW_ERROR(ValueError, "pipeline: the stage has no pipeline group");
  if (microbatches_ < 1) {
    C10_THROW_ERROR(ValueError,
                    "pipeline: microbatches must be >= 1, got " + std::to_string(microbatches_));
  }
  if (!loss_fn_) C10_THROW_ERROR(ValueError, "pipeline: no loss function");
}

PipelineStepResult GPipeSchedule::step(const at::Tensor& input, const at::Tensor& target) {
  const Group& group = *stage_.group;
  const int64_t stage = group.rank();
  const bool first = stage == 0, last = stage == group.size() - 1;
  if (first && !input.defined()) {
    C10_THROW_ERROR(ValueError, "pipeline: the first stage (pipeline rank 0) needs the input");
  }
  if (last && !target.defined()) {
    C10_THROW_ERROR(ValueError, "pipeline: the last stage (pipeline rank " + std::to_string(stage) +
                                    ") needs the target");
  }
  const auto inputs =
      first ? split_batch(input, microbatches_, "input") : std::vector<at::Tensor>();
  const auto targets =
      last ? split_batch(target, microbatches_, "target") : std::vector<at::Tensor>();
  const at::TensorOptions device = at::TensorOptions().device(stage_.device);

  // Forward of every microbatch; what backward needs is kept.
  std::vector<at::Tensor> stage_inputs, stage_outputs, losses;
  for (int64_t mb = 0; mb < microbatches_; ++mb) {
    at::Tensor x = first ? inputs[mb] : recv_activation(stage - 1, group, device);
    if (!first) x.requires_grad_(true);  // its gradient is sent back
    at::Tensor y = stage_.forward(x);
    if (last) {
      losses.push_back(loss_fn_(y, targets[mb]) / static_cast<double>(microbatches_));
    } else {
      send_activation(y.detach(), stage + 1, group);
    }
    stage_inputs.push_back(x);
    stage_outputs.push_back(y);
  }

  // Backward of every microbatch, in the same order; gradients reduce in the last one.
  std::vector<at::Tensor> output_grads, input_grads;
  for (int64_t mb = 0; mb < microbatches_; ++mb) {
    if (stage_.fsdp) stage_.fsdp->set_requires_gradient_sync(mb == microbatches_ - 1);
    if (last) {
      losses[mb].backward();
    } else {
      at::Tensor grad = at::empty_like(stage_outputs[mb]);
      recv(grad, stage + 1, group).wait();
      torch::autograd::backward({stage_outputs[mb]}, {grad});
      output_grads.push_back(grad);
    }
    if (!first) {
      at::Tensor grad = stage_inputs[mb].grad();
      if (!grad.defined()) grad = at::zeros_like(stage_inputs[mb]);  // input unused
      send(grad, stage - 1, group).wait();
      input_grads.push_back(grad);
    }
  }

  PipelineStepResult result;
  if (last) result.loss = at::stack(losses).sum().detach();
  if (!output_grads.empty()) result.output_grad = at::cat(output_grads);
  if (!input_grads.empty()) result.input_grad = at::cat(input_grads);
  return result;
}

}  // namespace hp
