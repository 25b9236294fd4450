// Optimizer state as whole tensors: each per-parameter state tensor is shaped like the
// parameter's local shard, so it is gathered and sliced exactly like the parameter.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "fsdp_param.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/state_dict.h"
#include "sharded_param_index.h"

namespace hp {
namespace {

using torch::optim::OptimizerParamState;
using Fields = std::map<std::string, at::Tensor>;  // field name -> tensor like the param

// How one optimizer class keeps its per-parameter state.
struct StateCodec {
  std::vector<std::string> field_names;
  bool has_step = false;
  std::function<Fields(OptimizerParamState&)> fields;
  std::function<int64_t(OptimizerParamState&)> step;
  std::function<std::unique_ptr<OptimizerParamState>(Fields&, int64_t step)> make;
};

template <typename AdamState>
StateCodec adam_codec() {
  StateCodec codec;
  codec.field_names = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  codec.has_step = true;
  codec.fields = [](OptimizerParamState& base) {
    auto& s = static_cast<AdamState&>(base);
    Fields fields{{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
    if (s.max_exp_avg_sq().defined()) fields["max_exp_avg_sq"] = s.max_exp_avg_sq();
    return fields;
  };
  codec.step = [](OptimizerParamState& base) { return static_cast<AdamState&>(base).step(); };
  codec.make = [](Fields& fields, int64_t step) {
    auto s = std::make_unique<AdamState>();
    s->step(step);
    s->exp_avg(fields.at("exp_avg"));
    s->exp_avg_sq(fields.at("exp_avg_sq"));
    if (fields.count("max_exp_avg_sq")) s->max_exp_avg_sq(fields.at("max_exp_avg_sq"));
    return s;
  };
  return codec;
}

StateCodec sgd_codec() {
  StateCodec codec;
  codec.field_names = {"momentum_buffer"};
  codec.fields = [](OptimizerParamState& base) {
    return Fields{
        {"momentum_buffer", static_cast<torch::optim::SGDParamState&>(base).momentum_buffer()}};
  };
  codec.make = [](Fields& fields, int64_t) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(fields.at("momentum_buffer"));
    return s;
  };
  return codec;
}

StateCodec codec_for(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    return adam_codec<torch::optim::AdamWParamState>();
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    return adam_codec<torch::optim::AdamParamState>();
  }
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return sgd_codec();
  throw std::invalid_argument(
      "full optimizer state dicts support torch::optim::Adam, AdamW and SGD; this optimizer "
      "is none of them");
}

OptimizerParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto it = optimizer.state().find(param.unsafeGetTensorImpl());
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

}  // namespace

StateDict get_full_optimizer_state_dict(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer) {
  c10::NoGradGuard no_grad;
  const StateCodec codec = codec_for(optimizer);
  const auto sharded = detail::index_sharded_params();
  StateDict state;
  for (const auto& item : model.named_parameters()) {
    OptimizerParamState* param_state = state_of(optimizer, item.value());
    auto it = sharded.find(item.value().unsafeGetTensorImpl());
    const detail::ShardedParam* shard = it != sharded.end() ? &it->second : nullptr;
    if (shard) {
      detail::require_sharded(*shard, item.key(), "get_full_optimizer_state_dict");
      // Every rank of the shard group joins each gather: agree on whether there is one.
      at::Tensor has_state = at::full({1}, param_state ? 1.0f : 0.0f);
      all_reduce(has_state, ReduceOp::kMin, *shard->shard_group).wait();
      if (has_state.item<float>() == 0.0f) continue;
    } else if (!param_state) {
      continue;
    }
    if (codec.has_step) {
      state.insert(item.key() + ".step", at::scalar_tensor(codec.step(*param_state), at::kLong));
    }
    for (const auto& [field, local] : codec.fields(*param_state)) {
      if (!local.defined()) continue;
      const at::Tensor whole =
          shard ? detail::gather_whole(*shard->param,
                                       shard->param->pad_local(local, local.scalar_type()),
                                       *shard->shard_group)
                : local.clone();
      state.insert(item.key() + "." + field, whole.to(at::kCPU));
    }
  }
  return state;
}

void set_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDict& state, bool strict) {
  c10::NoGradGuard no_grad;
  const StateCodec codec = codec_for(optimizer);
  const auto sharded = detail::index_sharded_params();
  std::set<std::string> used;
  // Built completely before anything is replaced, so that an error changes nothing.
  std::vector<std::pair<const c10::TensorImpl*, std::unique_ptr<OptimizerParamState>>> states;
  for (const auto& item : model.named_parameters()) {
    auto it = sharded.find(item.value().unsafeGetTensorImpl());
    const detail::ShardedParam* shard = it != sharded.end() ? &it->second : nullptr;
    const std::vector<int64_t> whole_shape =
        shard ? shard->param->layout().global_shape : item.value().sizes().vec();
    // The local part goes where the parameter's data lives (the host, when offloaded).
    const at::TensorOptions options =
        shard ? shard->param->sharded_view().options() : item.value().options();
    Fields fields;
    for (const auto& field : codec.field_names) {
      const std::string key = item.key() + "." + field;
      const at::Tensor* whole = state.find(key);
      if (!whole) continue;
      if (whole->sizes() != c10::IntArrayRef(whole_shape)) {
        throw std::invalid_argument("set_full_optimizer_state_dict: '" + key + "' has shape " +
                                    c10::str(whole->sizes()) + ", the parameter's is " +
                                    c10::str(c10::IntArrayRef(whole_shape)));
      }
      at::Tensor local = shard ? shard->param->local_part(*whole) : *whole;
      fields[field] = local.to(options.dtype(whole->scalar_type()), /*non_blocking=*/false,
                               /*copy=*/true);
      used.insert(key);
    }
    const at::Tensor* step = state.find(item.key() + ".step");
    if (step) used.insert(item.key() + ".step");
    if (fields.empty()) continue;
    if (codec.has_step && !step) {
      throw std::invalid_argument("set_full_optimizer_state_dict: no entry '" + item.key() +
                                  ".step' beside its other state");
    }
    states.emplace_back(item.value().unsafeGetTensorImpl(),
                        codec.make(fields, step ? step->item<int64_t>() : 0));
  }
  if (strict) {
    for (const auto& item : state) {
      if (!used.count(item.key())) {
        throw std::invalid_argument("set_full_optimizer_state_dict: '" + item.key() +
                                    "' is no state of this optimizer for a parameter of the "
                                    "model (strict)");
      }
    }
  }
  // Only this model's parameters: the optimizer may hold others too.
  for (const auto& item : model.named_parameters()) {
    optimizer.state().erase(item.value().unsafeGetTensorImpl());
  }
  for (auto& [key, param_state] : states) {
    optimizer.state()[const_cast<c10::TensorImpl*>(key)] = std::move(param_state);
  }
}

}  // namespace hp
