#pragma once
// The checkpoints of the killed-save test: a small model whose every parameter, and its
// extra "step", hold the step it was saved at, so that a mixed checkpoint shows two values.

#include <torch/torch.h>

#include <functional>
#include <string>

#include "hyperparallel/sharded_checkpoint.h"

namespace hp::testing {

inline torch::nn::Sequential stepped_model() {
  return torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::Linear(512, 512),
                               torch::nn::Linear(512, 512));
}

// How a checkpoint is saved: save_sharded_checkpoint, or an AsyncCheckpointSaver's save.
using SaveCheckpoint =
    std::function<void(const std::string& dir, torch::nn::Module& model, const StateDict& extra)>;

inline void save_synchronously(const std::string& dir, torch::nn::Module& model,
                               const StateDict& extra) {
  save_sharded_checkpoint(dir, model, nullptr, extra);
}

// Saves step `step`, then the previous step again (replacing a complete directory). The
// parameters change right after each save returns.
inline void save_step(torch::nn::Sequential& model, const std::string& root, int64_t step,
                      const SaveCheckpoint& save = save_synchronously) {
  torch::NoGradGuard no_grad;
  for (auto& param : model->parameters()) param.fill_(static_cast<double>(step));
  StateDict extra;
  extra.insert("step", at::scalar_tensor(step, at::kLong));
  save(checkpoint_dir_for_step(root, step), *model, extra);
  if (step > 1) {
    for (auto& param : model->parameters()) param.fill_(static_cast<double>(step - 1));
    extra["step"] = at::scalar_tensor(step - 1, at::kLong);
    save(checkpoint_dir_for_step(root, step - 1), *model, extra);
  }
}

}  // namespace hp::testing
