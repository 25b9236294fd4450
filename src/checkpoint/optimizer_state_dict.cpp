// Optimizer state as whole tensors, in memory or streamed to and from a checkpoint file:
// each per-parameter state tensor is shaped like the parameter's local shard, so it is
// gathered and sliced exactly like the parameter, one at a time.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <optional>
#include <set>

#include "../materialize/model_params.h"
#include "checkpoint_sink.h"
#include "full_tensor_source.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/state_dict.h"
#include "state_io.h"
#include "torch_save_reader.h"

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
  C10_THROW_ERROR(
      ValueError,
      "full optimizer state dicts support torch::optim::Adam, AdamW and SGD; this optimizer "
      "is none of them");
}

OptimizerParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  auto it = optimizer.state().find(param.unsafeGetTensorImpl());
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

using FullTensorVisitor = std::function<void(const std::string& name, const at::Tensor& whole)>;

// Calls `visit` for each per-parameter state tensor of the model's parameters with the
// whole tensor, a fresh host tensor gathered right before its call (a collective for
// sharded parameters) and dropped after it unless `visit` keeps it.
void for_each_full_optimizer_tensor(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const char* caller, const FullTensorVisitor& visit) {
  c10::NoGradGuard no_grad;
  const StateCodec codec = codec_for(optimizer);
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  // Checked before the first collective, so that all ranks throw or none does.
  for (const auto& p : params) {
    if (p.shard) detail::require_sharded(*p.shard, p.name, caller);
  }
  for (const auto& p : params) {
    OptimizerParamState* param_state = state_of(optimizer, p.variable);
    if (p.shard) {
      // Every rank of the shard group joins each gather: agree on whether there is one.
      at::Tensor has_state = at::full({1}, param_state ? 1.0f : 0.0f);
      all_reduce(has_state, ReduceOp::kMin, p.shard->shard_group()).wait();
      if (has_state.item<float>() == 0.0f) continue;
    } else if (!param_state) {
      continue;
    }
    if (codec.has_step) {
      visit(p.name + ".step", at::scalar_tensor(codec.step(*param_state), at::kLong));
    }
    for (const auto& [field, local] : codec.fields(*param_state)) {
      if (!local.defined()) continue;
      const at::Tensor slice = p.shard ? p.shard->full(local) : local;
      const at::Tensor whole = detail::whole_of(p, slice);
      const bool fresh = p.shard.has_value() || p.parallel_slice.has_value();
      visit(p.name + "." + field, whole.to(at::kCPU, /*non_blocking=*/false, /*copy=*/!fresh));
    }
  }
}

}  // namespace

namespace detail {
namespace {

// What loading gives each parameter of `params` from `source`, and the entries it reads.
struct OptimizerLoadPlan {
  struct Planned {
    const ModelParam* param;
    std::vector<std::string> fields;
    bool has_step = false;
  };
  std::vector<Planned> planned;
  std::set<std::string> used;
};

OptimizerLoadPlan plan_optimizer_load(const std::vector<ModelParam>& params,
                                      const StateCodec& codec, const FullTensorSource& source,
                                      const std::string& caller) {
  OptimizerLoadPlan plan;
  for (const auto& p : params) {
    OptimizerLoadPlan::Planned planned{&p, {}, false};
    for (const auto& field : codec.field_names) {
      const std::string key = p.name + "." + field;
      const std::optional<c10::IntArrayRef> shape = source.shape_of(key);
      if (!shape) continue;
      if (*shape != c10::IntArrayRef(p.whole_shape)) {
        C10_THROW_ERROR(ValueError, caller + ": '" + key + "' has shape " + c10::str(*shape) +
                                        " in " + source.description + ", the parameter's is " +
                                        c10::str(c10::IntArrayRef(p.whole_shape)));
      }
      planned.fields.push_back(field);
      plan.used.insert(key);
    }
    const std::string step_key = p.name + ".step";
    if (const std::optional<c10::IntArrayRef> shape = source.shape_of(step_key)) {
      if (c10::multiply_integers(*shape) != 1) {
        C10_THROW_ERROR(ValueError, caller + ": '" + step_key + "' has shape " + c10::str(*shape) +
                                        " in " + source.description + "; one number expected");
      }
      planned.has_step = true;
      plan.used.insert(step_key);
    }
    if (planned.fields.empty()) continue;
    if (codec.has_step && !planned.has_step) {
      C10_THROW_ERROR(ValueError, caller + ": no entry '" + step_key +
                                      "' beside its other state in " + source.description);
    }
    plan.planned.push_back(std::move(planned));
  }
  return plan;
}

}  // namespace

std::set<std::string> optimizer_entries(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const FullTensorSource& source, const std::string& caller) {
  return plan_optimizer_load(detail::model_params(model), codec_for(optimizer), source, caller)
      .used;
}

void load_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const FullTensorSource& source, bool strict, const std::string& caller) {
  c10::NoGradGuard no_grad;
  const StateCodec codec = codec_for(optimizer);
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  // Checked completely before anything is replaced, so that a bad state dict or file
  // leaves the optimizer unchanged.
  const OptimizerLoadPlan plan = plan_optimizer_load(params, codec, source, caller);
  detail::require_all_used(source, plan.used, strict, caller,
                           "no state of this optimizer for a parameter of the model");

  // Only this model's parameters: the optimizer may hold others too. Dropped first, so
  // that old and new state are not held together.
  for (const auto& p : params) optimizer.state().erase(p.variable.unsafeGetTensorImpl());
  try {
    for (const auto& planned : plan.planned) {
      const detail::ModelParam& p = *planned.param;
      // The local part goes where the parameter's data lives (the host, when offloaded).
      const at::TensorOptions options = p.shard ? p.shard->local().options() : p.variable.options();
      Fields fields;
      for (const auto& field : planned.fields) {
        const std::string key = p.name + "." + field;
        const at::Tensor local = detail::read_local_part(source, key, p);
        fields[field] = local.to(options.dtype(local.scalar_type()), /*non_blocking=*/false,
                                 /*copy=*/true);
      }
      const int64_t step = planned.has_step ? source.read(p.name + ".step").item<int64_t>() : 0;
      optimizer.state()[p.variable.unsafeGetTensorImpl()] = codec.make(fields, step);
    }
  } catch (const c10::ValueError&) {  // a bad argument: nothing was loaded
    throw;
  } catch (const c10::Error& error) {  // a record that cannot be read
    C10_THROW_ERROR(Error, caller + ": " + error.what_without_backtrace() +
                               "; the optimizer state is partly loaded: the parameters before "
                               "this one have their new state, the others none");
  }
}

std::optional<ParamOptimizerState> optimizer_state_of(torch::optim::Optimizer& optimizer,
                                                      const at::Tensor& param) {
  const StateCodec codec = codec_for(optimizer);
  OptimizerParamState* param_state = state_of(optimizer, param);
  if (!param_state) return std::nullopt;
  ParamOptimizerState result;
  if (codec.has_step) result.step = codec.step(*param_state);
  for (const auto& [field, local] : codec.fields(*param_state)) {
    if (local.defined()) result.fields[field] = local;
  }
  return result;
}

}  // namespace detail

StateDict get_full_optimizer_state_dict(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer) {
  StateDict state;
  for_each_full_optimizer_tensor(
      model, optimizer, "get_full_optimizer_state_dict",
      [&](const std::string& name, const at::Tensor& whole) { state.insert(name, whole); });
  return state;
}

void set_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDict& state, bool strict) {
  detail::load_optimizer_state(model, optimizer, detail::source_of(state), strict,
                               "set_full_optimizer_state_dict");
}

void save_full_optimizer_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const std::string& path) {
  detail::CheckpointSink sink(detail::writes_whole_tensors(model), path,
                              "save_full_optimizer_checkpoint");
  for_each_full_optimizer_tensor(
      model, optimizer, "save_full_optimizer_checkpoint",
      [&](const std::string& name, const at::Tensor& whole) { sink.write(name, whole); });
  sink.finish();
}

void load_full_optimizer_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const std::string& path, bool strict) {
  detail::TorchSaveReader reader(path);
  detail::load_optimizer_state(model, optimizer, detail::source_of(reader), strict,
                               "load_full_optimizer_checkpoint");
}

}  // namespace hp
