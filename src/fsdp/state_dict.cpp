#include "hyperparallel/state_dict.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <set>
#include <stdexcept>

#include "fsdp_param.h"
#include "hyperparallel/launch_env.h"
#include "sharded_param_index.h"

namespace hp {
namespace {

bool writes_checkpoints() {
  return std::getenv("RANK") == nullptr || LaunchEnv::from_environment().rank == 0;
}

}  // namespace

StateDict get_full_state_dict(torch::nn::Module& model) {
  c10::NoGradGuard no_grad;
  const auto sharded = detail::index_sharded_params();
  StateDict state;
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& param = item.value();
    auto it = sharded.find(param.unsafeGetTensorImpl());
    at::Tensor whole;
    if (it != sharded.end()) {
      detail::require_sharded(it->second, item.key(), "get_full_state_dict");
      const detail::FSDPParam& p = *it->second.param;
      whole = detail::gather_whole(p, p.padded_shard(), *it->second.shard_group);
    } else {
      whole = param.detach().clone();  // whole on every rank already
    }
    state.insert(item.key(), whole.to(at::kCPU));
  }
  for (const auto& item : model.named_buffers()) {
    state.insert(item.key(), item.value().detach().to(at::kCPU, /*non_blocking=*/false,
                                                      /*copy=*/true));
  }
  return state;
}

void set_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict) {
  c10::NoGradGuard no_grad;
  const auto sharded = detail::index_sharded_params();
  std::set<std::string> used;
  auto whole_of = [&](const std::string& name, c10::IntArrayRef shape) -> const at::Tensor& {
    const at::Tensor* found = state.find(name);
    if (!found) {
      throw std::invalid_argument("set_full_state_dict: no entry for '" + name +
                                  "' (the state dict has " + std::to_string(state.size()) +
                                  " entries); pass a state dict of this model");
    }
    if (found->sizes() != shape) {
      throw std::invalid_argument("set_full_state_dict: '" + name + "' has shape " +
                                  c10::str(found->sizes()) + ", the model's is " + c10::str(shape) +
                                  " (whole tensors expected)");
    }
    used.insert(name);
    return *found;
  };
  // Checked first, so that a bad state dict leaves the model unchanged.
  for (const auto& item : model.named_parameters()) {
    auto it = sharded.find(item.value().unsafeGetTensorImpl());
    if (it != sharded.end()) {
      detail::require_sharded(it->second, item.key(), "set_full_state_dict");
      whole_of(item.key(), it->second.param->layout().global_shape);
    } else {
      whole_of(item.key(), item.value().sizes());
    }
  }
  for (const auto& item : model.named_buffers()) whole_of(item.key(), item.value().sizes());
  if (strict && used.size() != state.size()) {
    for (const auto& item : state) {
      if (!used.count(item.key())) {
        throw std::invalid_argument("set_full_state_dict: '" + item.key() +
                                    "' is not a parameter or buffer of the model (strict)");
      }
    }
  }
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& whole = *state.find(item.key());
    auto it = sharded.find(item.value().unsafeGetTensorImpl());
    if (it != sharded.end()) {
      it->second.param->load_full(whole);
    } else {
      item.value().copy_(whole);
    }
  }
  for (const auto& item : model.named_buffers()) item.value().copy_(*state.find(item.key()));
}

void save_full_checkpoint(torch::nn::Module& model, const std::string& path) {
  const StateDict state = get_full_state_dict(model);
  if (writes_checkpoints()) write_state_dict_file(state, path);
}

void load_full_checkpoint(torch::nn::Module& model, const std::string& path, bool strict) {
  set_full_state_dict(model, read_state_dict_file(path), strict);
}

}  // namespace hp
