#pragma once
// Optimizers that step all parameters of one device and dtype with one of ATen's fused
// kernels (_fused_adamw_, _fused_adam_, _fused_sgd_; CPU and CUDA) instead of
// torch::optim's several kernels per parameter. Each is the torch::optim optimizer it is
// derived from: the same options and the same per-parameter state (step, exp_avg,
// exp_avg_sq, max_exp_avg_sq; momentum_buffer), so state dicts, torch::save archives,
// sharded checkpoints and their PyTorch interop are those of torch::optim, and the
// library's optimizer checkpoints take them as they are.
//
// Values: within rounding of torch::optim (the kernel computes each element in one pass,
// in the parameter's compute type), and bit for bit PyTorch's torch.optim.AdamW / Adam /
// SGD with fused=True (the same kernel; its step counts are fp32 tensors, as here).
//
// Every parameter with a gradient needs it dense, contiguous, of the parameter's dtype and
// on its device (fully_shard's sharded parameters and gradients are): otherwise step()
// throws c10::ValueError naming the parameter's group, index, shape, dtype and device.
// Parameters without a gradient are skipped, as torch::optim does.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace hp {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// Adam with L2 weight decay (added to the gradient), as torch::optim::Adam.
class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// SGD with momentum, dampening and Nesterov momentum, as torch::optim::SGD.
class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace hp
