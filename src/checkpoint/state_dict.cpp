// Full state dicts of a model, in memory or streamed to and from a checkpoint file: one
// whole tensor at a time, so that no rank ever holds the whole model.
#include "hyperparallel/state_dict.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <functional>
#include <set>

#include "../materialize/model_params.h"
#include "../materialize/whole_value.h"
#include "checkpoint_sink.h"
#include "full_tensor_source.h"
#include "state_io.h"
#include "torch_save_reader.h"

namespace hp {
namespace {

using FullTensorVisitor = std::function<void(const std::string& name, const at::Tensor& whole)>;

// Calls `visit` for every parameter and buffer of `model` in its order with the whole
// tensor, a fresh host tensor: a sharded parameter is all-gathered over its shard group
// right before its call (a collective). Unless `visit` keeps it, it is dropped after the
// call, so at most one whole tensor is alive here at a time.
void for_each_full_tensor(torch::nn::Module& model, const char* caller,
                          const FullTensorVisitor& visit) {
  c10::NoGradGuard no_grad;
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  // Checked before the first gather, so that all ranks throw or none does.
  for (const auto& p : params) {
    if (p.shard) detail::require_sharded(*p.shard, p.name, caller);
  }
  for (const auto& p : params) {
    if (p.shard) {
      const at::Tensor slice = p.shard->full();
      visit(p.name, detail::whole_of(p, slice).to(at::kCPU));
    } else {
      visit(p.name, detail::whole_of(p, p.variable.detach())
                        .to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
    }
  }
  for (const auto& item : model.named_buffers()) {
    visit(item.key(), item.value().detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
}

}  // namespace

namespace detail {

std::set<std::string> model_entries(torch::nn::Module& model, const FullTensorSource& source,
                                    const std::string& caller) {
  std::set<std::string> used;
  auto require_whole = [&](const std::string& name, c10::IntArrayRef shape) {
    const std::optional<c10::IntArrayRef> found = source.shape_of(name);
    if (!found) {
      C10_THROW_ERROR(ValueError, caller + ": no entry for '" + name + "' in " +
                                      source.description + " (" +
                                      std::to_string(source.names.size()) +
                                      " entries there); pass one saved from this model");
    }
    if (*found != shape) {
      C10_THROW_ERROR(ValueError, caller + ": '" + name + "' has shape " + c10::str(*found) +
                                      " in " + source.description + ", the model's is " +
                                      c10::str(shape) + " (whole tensors expected)");
    }
    used.insert(name);
  };
  for (const auto& p : detail::model_params(model)) {
    if (p.shard) detail::require_sharded(*p.shard, p.name, caller.c_str());
    require_whole(p.name, p.whole_shape);
  }
  for (const auto& item : model.named_buffers()) require_whole(item.key(), item.value().sizes());
  return used;
}

void load_model_state(torch::nn::Module& model, const FullTensorSource& source, bool strict,
                      const std::string& caller) {
  c10::NoGradGuard no_grad;
  // Everything the names and shapes tell is checked first, so that a bad state dict or
  // file leaves the model unchanged.
  detail::require_all_used(source, model_entries(model, source, caller), strict, caller,
                           "not a parameter or buffer of the model");
  const std::vector<detail::ModelParam> params = detail::model_params(model);
  try {
    // A model made by deferred_init may be loaded instead of materialized: its tensors
    // then take their values from here.
    for (const auto& p : params) {
      if (p.shard) {
        detail::set_local_value(p.variable, *p.shard, detail::read_local_part(source, p.name, p));
      } else {
        detail::set_whole_value(p.variable, detail::read_local_part(source, p.name, p), nullptr);
      }
    }
    for (const auto& item : model.named_buffers()) {
      detail::set_whole_value(item.value(), source.read(item.key()), nullptr);
    }
  } catch (const c10::ValueError&) {  // a bad argument: nothing was loaded
    throw;
  } catch (const c10::Error& error) {  // a record that cannot be read
    C10_THROW_ERROR(Error, caller + ": " + error.what_without_backtrace() +
                               "; the model is partly loaded (the tensors before this one)");
  }
}

}  // namespace detail

StateDict get_full_state_dict(torch::nn::Module& model) {
  StateDict state;
  for_each_full_tensor(
      model, "get_full_state_dict",
      [&](const std::string& name, const at::Tensor& whole) { state.insert(name, whole); });
  return state;
}

void set_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict) {
  detail::load_model_state(model, detail::source_of(state), strict, "set_full_state_dict");
}

void save_full_checkpoint(torch::nn::Module& model, const std::string& path) {
  detail::CheckpointSink sink(detail::writes_whole_tensors(model), path, "save_full_checkpoint");
  for_each_full_tensor(
      model, "save_full_checkpoint",
      [&](const std::string& name, const at::Tensor& whole) { sink.write(name, whole); });
  sink.finish();
}

void load_full_checkpoint(torch::nn::Module& model, const std::string& path, bool strict) {
  detail::TorchSaveReader reader(path);
  detail::load_model_state(model, detail::source_of(reader), strict, "load_full_checkpoint");
}

}  // namespace hp
