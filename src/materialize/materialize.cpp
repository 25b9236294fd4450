// materialize(): gives the deferred parameters and buffers of a module their values,
// replayed by the deferred-init engine or made by a user init function, one tensor at a
// time: into fully_shard's shard for a sharded parameter, in place for any other tensor.
#include "hyperparallel/materialize.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../deferred_init/deferred_init_engine.h"
#include "hyperparallel/deferred_init.h"
#include "model_params.h"
#include "whole_value.h"

namespace hp {
namespace {

struct Target {
  std::string name;
  at::Tensor tensor;
};

// The still-deferred tensors among `items` (named_parameters / named_buffers), each once:
// tied parameters share one variable.
void add_deferred(const torch::OrderedDict<std::string, at::Tensor>& items,
                  std::set<const c10::TensorImpl*>& seen, std::vector<Target>& targets) {
  for (const auto& item : items) {
    const at::Tensor& tensor = item.value();
    if (is_deferred(tensor) && seen.insert(tensor.unsafeGetTensorImpl()).second) {
      targets.push_back({item.key(), tensor});
    }
  }
}

// The fully_shard view of each target, checked before any work: unset for a tensor that
// is not sharded.
std::vector<std::optional<ShardedParameter>> sharded_views(const std::vector<Target>& targets) {
  std::vector<std::optional<ShardedParameter>> views;
  for (const Target& target : targets) {
    views.push_back(sharded_parameter_of(target.tensor));
    if (views.back()) detail::require_sharded(*views.back(), target.name, "materialize");
  }
  return views;
}

void deliver(const Target& target, const at::Tensor& whole,
             const std::optional<ShardedParameter>& view) {
  detail::set_whole_value(target.tensor, whole, view ? &*view : nullptr);
}

void replay_into(const std::vector<Target>& targets) {
  const std::vector<std::optional<ShardedParameter>> views = sharded_views(targets);
  std::vector<at::Tensor> tensors;
  for (const Target& target : targets) tensors.push_back(target.tensor);
  detail::replay_deferred(tensors, [&](size_t index, const at::Tensor& whole) {
    deliver(targets[index], whole, views[index]);
  });
}

}  // namespace

void materialize(torch::nn::Module& module) {
  std::set<const c10::TensorImpl*> seen;
  std::vector<Target> targets;
  add_deferred(module.named_parameters(), seen, targets);
  add_deferred(module.named_buffers(), seen, targets);
  replay_into(targets);
}

void materialize(torch::nn::Module& module,
                 std::function<void(const std::string& name, at::Tensor& whole)> init) {
  // Called inside a deferred_init, the allocations below would be recorded, not made.
  c10::impl::ExcludeDispatchKeyGuard not_recorded(c10::DispatchKey::DeferredInit);
  std::set<const c10::TensorImpl*> seen;
  std::vector<Target> params;
  add_deferred(module.named_parameters(), seen, params);
  const std::vector<std::optional<ShardedParameter>> views = sharded_views(params);
  for (size_t i = 0; i < params.size(); ++i) {
    const Target& target = params[i];
    // A sharded parameter's variable holds only its shard by now.
    const std::vector<int64_t> shape =
        views[i] ? views[i]->global_shape() : target.tensor.sizes().vec();
    const at::TensorOptions options =
        target.tensor.options().device(*detail::deferred_device(target.tensor));
    at::Tensor whole = at::empty(shape, options);
    {
      c10::NoGradGuard no_grad;
      init(target.name, whole);
    }
    if (!whole.defined() || whole.sizes() != at::IntArrayRef(shape) ||
        whole.scalar_type() != target.tensor.scalar_type()) {
      C10_THROW_ERROR(ValueError, "materialize: the init function replaced parameter '" +
                                      target.name + "' (shape " + c10::str(shape) + ", " +
                                      c10::toString(target.tensor.scalar_type()) +
                                      ") by another tensor; fill the tensor it is given in place");
    }
    deliver(target, whole, views[i]);
  }
  std::vector<Target> buffers;
  add_deferred(module.named_buffers(), seen, buffers);
  replay_into(buffers);
}

}  // namespace hp
