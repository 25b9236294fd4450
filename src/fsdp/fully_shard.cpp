// fully_shard(): checks and decides what a call manages (fsdp_init.h), builds the
// FSDPParamGroup and the FSDPState, and links the modules to the state.
#include "hyperparallel/fully_shard.h"

#include <c10/util/Exception.h>

#include "fsdp_init.h"
#include "state_registry.h"

namespace hp {

std::vector<FSDPModule> fully_shard(const std::vector<ShardableModule>& modules,
                                    FullyShardOptions options) {
  TORCH_CHECK_VALUE(!modules.empty(), "fully_shard needs at least one module");
  TORCH_CHECK_VALUE(options.comm_policy.block_size > 0,
                    "comm_policy.block_size must be > 0 (values per quantization scale), got ",
                    options.comm_policy.block_size);
  TORCH_CHECK_VALUE(!options.comm_policy.error_feedback ||
                        options.comm_policy.reduce_scatter_codec != CommCodec::kNone,
                    "comm_policy.error_feedback keeps the quantized reduce-scatter's residual, "
                    "and comm_policy.reduce_scatter_codec is none: set a codec or turn error "
                    "feedback off");
  TORCH_CHECK_VALUE(options.comm_fusion_bucket_bytes >= 0,
                    "comm_fusion_bucket_bytes must be >= 0 (0: one collective per module), got ",
                    options.comm_fusion_bucket_bytes);
  TORCH_CHECK_VALUE(options.comm_fusion || options.comm_fusion_bucket_bytes == 0,
                    "comm_fusion_bucket_bytes sizes the collectives of comm_fusion, which is "
                    "off: set comm_fusion = true or leave comm_fusion_bucket_bytes at 0");
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
  auto [reshard_after_forward, post_forward_group] =
      detail::resolve_reshard_after_forward(options.reshard_after_forward, mesh_info);
  detail::ManagedParams managed = detail::managed_params(module_ptrs, options, mesh_info);
  detail::move_states_to_mesh_device(module_ptrs, managed.replicated, mesh_info.world->device());

  auto param_group = std::make_unique<detail::FSDPParamGroup>(
      std::move(managed.sharded), std::move(managed.replicated), mesh_info,
      detail::CommFusion{options.comm_fusion, options.comm_fusion_bucket_bytes},
      options.comm_policy);
  param_group->set_post_forward_group(post_forward_group);
  auto state = std::make_shared<detail::FSDPState>(
      std::move(param_group), options.mp_policy, reshard_after_forward,
      [roots] { return detail::states_in_subtree(roots); });
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
