#pragma once
// The state of one hyperparallel.fully_shard call on Python modules: the core's FSDPState,
// built from the parameters Python offers (detail::build_state, as the C++ front-end does),
// and the hooks Python's forward hooks call. Everything the hooks do (unshard, reshard,
// prefetch, casts, the backward reductions) is the core's; this class only passes tensors.

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fsdp_state.h"
#include "hyperparallel/fully_shard.h"

namespace hp::python {

// The groups of one mesh, as fully_shard uses them (detail::FSDPMeshInfo).
struct MeshGroups {
  std::vector<std::string> dims;  // (replicate,) shard
  GroupPtr shard;
  GroupPtr shard_reduce;  // the shard ranks again: reduce-scatters overlap all-gathers
  GroupPtr replicate;     // one rank for 1-D FSDP
  GroupPtr data_parallel;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
};

// fully_shard's arguments beyond the mesh, as Python resolved them.
struct ShardOptions {
  FullyShardOptions core;  // mesh, reshard_after_forward and shard_placement_fn unset
  std::optional<bool> reshard_after_forward;
  GroupPtr post_forward_group;  // reshard_after_forward = k: this rank's k shard ranks
  // shard_placement_fn's answers by parameter name: a shard dim, or nullopt for Replicate().
  std::map<std::string, std::optional<int64_t>> placements;
};

// One sharded parameter as Python shows it: the variable autograd sees while unsharded
// (the module's original nn.Parameter) and this rank's shard (a view the DTensor wraps).
struct ShardedParamView {
  std::string name;
  at::Tensor variable;
  at::Tensor local;
  int64_t shard_dim;
  std::vector<int64_t> global_shape;
};

class ShardState;
using ShardStatePtr = std::shared_ptr<ShardState>;
// The states of a subtree, (module path, state), for the core's lazy root initialization.
using SubtreeFn = std::function<std::vector<std::pair<std::string, ShardStatePtr>>()>;

class ShardState {
 public:
  // named: the candidates by qualified name; taken: parameters of fully_shard-ed
  // submodules; existing: the states of earlier calls.
  ShardState(std::vector<std::pair<std::string, at::Tensor>> named, std::vector<at::Tensor> taken,
             const MeshGroups& groups, ShardOptions options,
             const std::vector<ShardStatePtr>& existing, SubtreeFn subtree);

  // The hooks; each returns the tensors it was given, possibly replaced (cast inputs,
  // outputs hooked for backward).
  std::vector<at::Tensor> pre_forward(std::vector<at::Tensor> inputs);
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs);
  void forward_failed();

  bool is_unsharded() const;
  std::vector<ShardedParamView> sharded_params() const;
  // Sharded parameter `index` (of sharded_params()) was moved or cast with its module
  // (module.to(), to_empty()): the core's shard follows `local`. Returns the new shard view.
  at::Tensor move_shard(int64_t index, const at::Tensor& local);
  FSDPModule module() const;
  const detail::StatePtr& core() const { return state_; }

 private:
  detail::StatePtr state_;
};

}  // namespace hp::python
