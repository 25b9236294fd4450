#include "shard_state.h"

#include <c10/util/Exception.h>

#include "fsdp/fsdp_init.h"
#include "fsdp/state_registry.h"

namespace hp::python {
namespace {

std::vector<at::Tensor*> pointers_to(std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor*> pointers;
  pointers.reserve(tensors.size());
  for (auto& tensor : tensors) pointers.push_back(&tensor);
  return pointers;
}

detail::FSDPMeshInfo mesh_info_of(const MeshGroups& groups) {
  TORCH_CHECK_VALUE(groups.shard && groups.shard_reduce && groups.replicate && groups.data_parallel,
                    "fully_shard: the mesh's groups are incomplete");
  detail::FSDPMeshInfo info;
  info.dims = groups.dims;
  info.shard = groups.shard;
  info.shard_reduce = groups.shard_reduce;
  info.replicate = groups.replicate;
  info.data_parallel = groups.data_parallel;
  info.device = groups.device;
  return info;
}

}  // namespace

ShardState::ShardState(std::vector<std::pair<std::string, at::Tensor>> named,
                       std::vector<at::Tensor> taken, const MeshGroups& groups,
                       ShardOptions options, const std::vector<ShardStatePtr>& existing,
                       SubtreeFn subtree) {
  detail::CandidateParams candidates;
  candidates.named = std::move(named);
  candidates.meta_moved_by_front_end = true;  // module.to_empty(), then move_shard
  for (const auto& tensor : taken) candidates.taken.insert(tensor.unsafeGetTensorImpl());
  auto placements = std::move(options.placements);
  if (!placements.empty()) {
    options.core.shard_placement_fn = [placements](const std::string& name, const at::Tensor&) {
      const auto found = placements.find(name);
      if (found == placements.end()) return std::optional<Placement>();
      return std::optional<Placement>(found->second ? Placement::shard(*found->second)
                                                    : Placement::replicate());
    };
  }
  std::vector<detail::StatePtr> existing_states;
  for (const auto& state : existing) existing_states.push_back(state->core());
  state_ = detail::build_state(candidates, options.core, mesh_info_of(groups),
                               {options.reshard_after_forward, options.post_forward_group},
                               existing_states, [subtree = std::move(subtree)] {
                                 std::vector<detail::LabeledState> states;
                                 for (auto& [path, state] : subtree())
                                   states.emplace_back(path, state->core());
                                 return states;
                               });
}

std::vector<at::Tensor> ShardState::pre_forward(std::vector<at::Tensor> inputs) {
  state_->pre_forward(pointers_to(inputs));
  return inputs;
}

std::vector<at::Tensor> ShardState::post_forward(std::vector<at::Tensor> outputs) {
  state_->post_forward(pointers_to(outputs));
  return outputs;
}

void ShardState::forward_failed() { state_->forward_failed(); }

bool ShardState::is_unsharded() const { return state_->param_group().is_unsharded(); }

std::vector<ShardedParamView> ShardState::sharded_params() const {
  std::vector<ShardedParamView> views;
  for (const auto& p : state_->param_group().params()) {
    views.push_back(
        {p->name(), p->variable(), p->sharded_view(), p->layout().dim, p->layout().global_shape});
  }
  return views;
}

at::Tensor ShardState::move_shard(int64_t index, const at::Tensor& local) {
  const auto& params = state_->param_group().params();
  TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(params.size()),
                    "no sharded parameter ", index);
  params[index]->move_shard(local);
  return params[index]->sharded_view();
}

FSDPModule ShardState::module() const { return detail::FSDPModuleAccess::make(state_); }

}  // namespace hp::python
