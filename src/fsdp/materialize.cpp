// materialize(): gives the deferred parameters and buffers of a module their values,
// replayed by the deferred-init engine or made by a user init function, one tensor at a
// time: into fully_shard's shard for a sharded parameter, in place for any other tensor.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "../runtime/deferred_init_engine.h"
#include "fsdp_param.h"
#include "hyperparallel/deferred_init.h"
#include "sharded_param_index.h"
#include "whole_value.h"

namespace hp {
namespace {

using ShardedIndex = std::map<const c10::TensorImpl*, detail::ShardedParam>;

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

const detail::ShardedParam* sharded_param(const ShardedIndex& sharded, const Target& target) {
  auto found = sharded.find(target.tensor.unsafeGetTensorImpl());
  if (found == sharded.end()) return nullptr;
  detail::require_sharded(found->second, target.name, "materialize");
  return &found->second;
}

void deliver(const Target& target, const at::Tensor& whole, const ShardedIndex& sharded) {
  detail::set_whole_value(target.tensor, whole, sharded_param(sharded, target));
}

void replay_into(const std::vector<Target>& targets) {
  const ShardedIndex sharded = detail::index_sharded_params();
  for (const Target& target : targets) sharded_param(sharded, target);  // check before any work
  std::vector<at::Tensor> tensors;
  for (const Target& target : targets) tensors.push_back(target.tensor);
  detail::replay_deferred(tensors, [&](size_t index, const at::Tensor& whole) {
    deliver(targets[index], whole, sharded);
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
  const ShardedIndex sharded = detail::index_sharded_params();
  std::vector<const detail::ShardedParam*> sharded_params;  // checked before any work
  for (const Target& target : params) sharded_params.push_back(sharded_param(sharded, target));
  for (size_t i = 0; i < params.size(); ++i) {
    const Target& target = params[i];
    // A sharded parameter's variable holds only its shard by now.
    const std::vector<int64_t> shape = sharded_params[i]
                                           ? sharded_params[i]->param->layout().global_shape
                                           : target.tensor.sizes().vec();
    const at::TensorOptions options =
        target.tensor.options().device(*detail::deferred_device(target.tensor));
    at::Tensor whole = at::empty(shape, options);
    {
      c10::NoGradGuard no_grad;
      init(target.name, whole);
    }
    if (!whole.defined() || whole.sizes() != at::IntArrayRef(shape) ||
        whole.scalar_type() != target.tensor.scalar_type()) {
      throw std::invalid_argument("materialize: the init function replaced parameter '" +
                                  target.name + "' (shape " + c10::str(shape) + ", " +
                                  c10::toString(target.tensor.scalar_type()) +
                                  ") by another tensor; fill the tensor it is given in place");
    }
    deliver(target, whole, sharded);
  }
  std::vector<Target> buffers;
  add_deferred(module.named_buffers(), seen, buffers);
  replay_into(buffers);
}

}  // namespace hp
