#include "hyperparallel/fused_optimizers.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace hp {
namespace {

// The tensors of one fused call: parameters of one device and dtype, and their states in
// the kernel's argument order.
struct FusedBatch {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<at::Tensor> params, grads, first_moments, second_moments, max_second_moments;
  std::vector<float> steps;  // the counts after this step
};

FusedBatch& batch_of(std::vector<FusedBatch>& batches, const at::Tensor& param) {
  for (FusedBatch& batch : batches) {
    if (batch.device == param.device() && batch.dtype == param.scalar_type()) return batch;
  }
  return batches.emplace_back(FusedBatch{param.device(), param.scalar_type()});
}

// Throws c10::ValueError unless the kernel can step `param` with `grad`.
void check_fusable(const char* optimizer, size_t group, size_t index, const at::Tensor& param,
                   const at::Tensor& grad) {
  const auto where = [&] {
    return std::string(optimizer) + ": parameter " + std::to_string(index) + " of group " +
           std::to_string(group) + " (" +
           c10::str(param.sizes(), " ", param.scalar_type(), " on ", param.device()) + ")";
  };
  TORCH_CHECK_VALUE(
      !grad.is_sparse(), where(),
      " has a sparse gradient; the fused kernel needs a dense one (use torch::optim's "
      "optimizer for sparse gradients)");
  TORCH_CHECK_VALUE(grad.scalar_type() == param.scalar_type() && grad.device() == param.device(),
                    where(), " has a gradient of ", grad.scalar_type(), " on ", grad.device(),
                    "; the fused kernel needs the parameter's dtype and device");
  TORCH_CHECK_VALUE(param.is_contiguous() && grad.is_contiguous(), where(),
                    " or its gradient is not contiguous; the fused kernel needs both contiguous");
}

// The step counts of `batch` as the kernel takes them: fp32 scalars on its device, views
// of one tensor (one copy to a GPU, not one per parameter).
std::vector<at::Tensor> step_tensors(const FusedBatch& batch) {
  const at::Tensor all =
      at::tensor(batch.steps, at::kFloat).to(batch.device, /*non_blocking=*/false);
  std::vector<at::Tensor> steps;
  for (int64_t i = 0; i < all.numel(); ++i) steps.push_back(all.select(0, i));
  return steps;
}

// Adam and AdamW: the same state and options, the kernel differs in how weight decay
// enters (added to the gradient, or decoupled).
template <typename Options, typename State, typename Kernel>
void step_adam_family(torch::optim::Optimizer& optimizer, const char* name, Kernel&& kernel) {
  auto& state = optimizer.state();
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& group = optimizer.param_groups()[g];
    const auto& options = static_cast<const Options&>(group.options());
    std::vector<FusedBatch> batches;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& param = group.params()[i];
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      check_fusable(name, g, i, param, grad);
      std::unique_ptr<torch::optim::OptimizerParamState>& slot = state[param.unsafeGetTensorImpl()];
      if (!slot) {  // as torch::optim: zeros at the first step
        auto fresh = std::make_unique<State>();
        fresh->exp_avg(at::zeros_like(param, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
        if (options.amsgrad()) {
          fresh->max_exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
        }
        slot = std::move(fresh);
      }
      auto& s = static_cast<State&>(*slot);
      s.step(s.step() + 1);
      FusedBatch& batch = batch_of(batches, param);
      batch.params.push_back(param);
      batch.grads.push_back(grad);
      batch.first_moments.push_back(s.exp_avg());
      batch.second_moments.push_back(s.exp_avg_sq());
      if (options.amsgrad()) batch.max_second_moments.push_back(s.max_exp_avg_sq());
      batch.steps.push_back(static_cast<float>(s.step()));
    }
    for (const FusedBatch& batch : batches) kernel(batch, step_tensors(batch), options);
  }
}

at::Tensor loss_of(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enabled(true);
  return closure();
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  const at::Tensor loss = loss_of(closure);
  c10::NoGradGuard no_grad;
  step_adam_family<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, "FusedAdamW",
      [](const FusedBatch& b, const std::vector<at::Tensor>& steps,
         const torch::optim::AdamWOptions& o) {
        at::_fused_adamw_(b.params, b.grads, b.first_moments, b.second_moments,
                          b.max_second_moments, steps, o.lr(), std::get<0>(o.betas()),
                          std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(),
                          /*maximize=*/false);
      });
  return loss;
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  const at::Tensor loss = loss_of(closure);
  c10::NoGradGuard no_grad;
  step_adam_family<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      *this, "FusedAdam",
      [](const FusedBatch& b, const std::vector<at::Tensor>& steps,
         const torch::optim::AdamOptions& o) {
        at::_fused_adam_(b.params, b.grads, b.first_moments, b.second_moments, b.max_second_moments,
                         steps, o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()),
                         o.weight_decay(), o.eps(), o.amsgrad(),
                         /*maximize=*/false);
      });
  return loss;
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  const at::Tensor loss = loss_of(closure);
  c10::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    // A parameter's first step with momentum starts its buffer from the gradient: the
    // kernel does that for a whole call, so first steps go in calls of their own.
    std::vector<FusedBatch> later, first;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& param = group.params()[i];
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      check_fusable("FusedSGD", g, i, param, grad);
      if (o.momentum() == 0) {  // no state, as torch::optim::SGD
        FusedBatch& batch = batch_of(later, param);
        batch.params.push_back(param);
        batch.grads.push_back(grad);
        continue;
      }
      std::unique_ptr<torch::optim::OptimizerParamState>& slot =
          state_[param.unsafeGetTensorImpl()];
      const bool starts = !slot;
      if (starts) {
        auto fresh = std::make_unique<torch::optim::SGDParamState>();
        fresh->momentum_buffer(at::empty_like(param, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      FusedBatch& batch = batch_of(starts ? first : later, param);
      batch.params.push_back(param);
      batch.grads.push_back(grad);
      batch.first_moments.push_back(
          static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer());
    }
    for (const auto& [batches, is_first_step] :
         {std::pair{&later, false}, std::pair{&first, true}}) {
      for (const FusedBatch& b : *batches) {
        at::_fused_sgd_(b.params, b.grads, b.first_moments, o.weight_decay(), o.momentum(), o.lr(),
                        o.dampening(), o.nesterov(), /*maximize=*/false, is_first_step);
      }
    }
  }
  return loss;
}

}  // namespace hp
