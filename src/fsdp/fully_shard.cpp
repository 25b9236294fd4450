// fully_shard() for C++ modules: offers their parameters to the state fsdp_init.h builds,
// and links the modules to the state.
#include "hyperparallel/fully_shard.h"

#include <c10/util/Exception.h>

#include "fsdp_init.h"
#include "state_registry.h"

namespace hp {

std::vector<FSDPModule> fully_shard(const std::vector<ShardableModule>& modules,
                                    FullyShardOptions options) {
  TORCH_CHECK_VALUE(!modules.empty(), "fully_shard needs at least one module");
  std::vector<detail::ModulePtr> module_ptrs;
  std::vector<std::weak_ptr<torch::nn::Module>> roots;
  for (const auto& m : modules) {
    TORCH_CHECK_VALUE(!detail::state_of(m.module().get()),
                      "fully_shard was already applied to this module (", m.module()->name(),
                      "); apply it once per module");
    module_ptrs.push_back(m.module());
    roots.push_back(m.module());
  }
  detail::FSDPMeshInfo mesh_info = detail::resolve_mesh(options.mesh);
  auto state = detail::build_state(
      detail::candidate_params(module_ptrs), options, mesh_info,
      detail::resolve_reshard_after_forward(options.reshard_after_forward, mesh_info),
      detail::all_states(), [roots] { return detail::states_in_subtree(roots); });
  detail::move_buffers_to_mesh_device(module_ptrs, mesh_info.device);
  std::vector<FSDPModule> result;
  for (const auto& m : modules) {
    detail::register_state(m.module(), state);
    result.push_back(detail::FSDPModuleAccess::make(state));
  }
  return result;
}

FSDPModule fully_shard(ShardableModule module, FullyShardOptions options) {
  return fully_shard(std::vector<ShardableModule>{std::move(module)}, std::move(options)).front();
}

}  // namespace hp
