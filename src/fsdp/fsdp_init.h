#pragma once
// What fully_shard() decides before it builds a state (FSDP2's _fsdp_init): the groups
// of the mesh, where parameters are resharded after forward, which parameters a call
// manages and how each is placed. Every check of fully_shard's arguments is here, so a
// call that fails leaves nothing behind.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp_param.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"
#include "hyperparallel/fully_shard.h"

namespace hp::detail {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

// The groups fully_shard uses on `requested` (the default world's 1-D mesh if unset).
FSDPMeshInfo resolve_mesh(const std::optional<DeviceMesh>& requested);

// reshard_after_forward: whether to reshard after forward (unset: decided at the root),
// and for an int k, the group of k consecutive shard ranks this rank reshards to.
std::pair<std::optional<bool>, GroupPtr> resolve_reshard_after_forward(
    const std::optional<std::variant<bool, int64_t>>& option, const FSDPMeshInfo& mesh_info);

// The parameters a fully_shard call over `modules` manages: the sharded ones and those
// every rank holds whole (replicate_params, Replicate() placements, scalars).
struct ManagedParams {
  std::vector<std::unique_ptr<FSDPParam>> sharded;
  std::vector<ReplicatedParam> replicated;
};
ManagedParams managed_params(const std::vector<ModulePtr>& modules,
                             const FullyShardOptions& options, const FSDPMeshInfo& mesh_info);

// The module states a call does not shard (replicated parameters, buffers) follow the
// sharded ones to a GPU mesh's device (FSDP2's move of module states).
void move_states_to_mesh_device(const std::vector<ModulePtr>& modules,
                                std::vector<ReplicatedParam>& replicated, c10::Device device);

// The states of the subtrees of `roots`, named by module path ("" for a root).
std::vector<LabeledState> states_in_subtree(
    const std::vector<std::weak_ptr<torch::nn::Module>>& roots);

}  // namespace hp::detail
