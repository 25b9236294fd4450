#pragma once
// What fully_shard() decides before it builds a state (FSDP2's _fsdp_init): the groups
// of the mesh, where parameters are resharded after forward, which parameters a call
// manages and how each is placed. Every check of fully_shard's arguments is here, so a
// call that fails leaves nothing behind.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
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

// The parameters offered to one fully_shard call, from the front-end's modules: by qualified
// name ("i." prefixed for several modules), and those a fully_shard-ed submodule manages
// (they belong to it, whole subtree included).
struct CandidateParams {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::set<const c10::TensorImpl*> taken;
  // The front-end moves meta parameters itself (ParamPolicy::meta_moved_by_front_end).
  bool meta_moved_by_front_end = false;
};
CandidateParams candidate_params(const std::vector<ModulePtr>& modules);

// The parameters a fully_shard call manages: the sharded ones and those every rank holds
// whole (replicate_params, Replicate() placements, scalars). `existing`: the states of
// earlier calls, whose parameters cannot be managed twice.
struct ManagedParams {
  std::vector<std::unique_ptr<FSDPParam>> sharded;
  std::vector<ReplicatedParam> replicated;
};
ManagedParams managed_params(const CandidateParams& candidates, const FullyShardOptions& options,
                             const FSDPMeshInfo& mesh_info, const std::vector<StatePtr>& existing);

// The state of one fully_shard call, for every front-end (C++ modules, Python modules):
// checks the options, places the candidates, moves replicated parameters to the mesh's
// device. `reshard_after_forward` as resolve_reshard_after_forward returns it; `subtree`
// lists the states of the call's modules' subtrees (FSDPState). A call that throws leaves
// the parameters as they were.
StatePtr build_state(const CandidateParams& candidates, const FullyShardOptions& options,
                     const FSDPMeshInfo& mesh_info,
                     std::pair<std::optional<bool>, GroupPtr> reshard_after_forward,
                     const std::vector<StatePtr>& existing,
                     std::function<std::vector<LabeledState>()> subtree);

// The buffers of the modules a call shards follow the parameters to a GPU mesh's device
// (FSDP2's move of module states).
void move_buffers_to_mesh_device(const std::vector<ModulePtr>& modules, c10::Device device);

// The states of the subtrees of `roots`, named by module path ("" for a root).
std::vector<LabeledState> states_in_subtree(
    const std::vector<std::weak_ptr<torch::nn::Module>>& roots);

}  // namespace hp::detail
