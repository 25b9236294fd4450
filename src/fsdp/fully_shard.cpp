// fully_shard(): decides which parameters a call manages and how, builds their
// FSDPParams, the FSDPParamGroup and the FSDPState, and links the modules to the state.
#include "hyperparallel/fully_shard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "fsdp_param.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"
#include "hyperparallel/parallel_slice.h"
#include "state_registry.h"

namespace hp {
namespace {

using detail::FSDPState;
using ModulePtr = std::shared_ptr<torch::nn::Module>;

const c10::TensorImpl* key(const at::Tensor& tensor) { return tensor.unsafeGetTensorImpl(); }

DeviceMesh default_mesh() {
  static DeviceMesh mesh(default_world(), {{"dp_shard", default_world()->size()}});
  return mesh;
}

detail::FSDPMeshInfo resolve_mesh(const std::optional<DeviceMesh>& requested) {
  DeviceMesh mesh = requested ? *requested : default_mesh();
  detail::FSDPMeshInfo mesh_info;
  mesh_info.world = mesh.world();
  // Reduce-scatters get their own group over the shard ranks, created once per shard
  // group by every member (in fully_shard order, the same on all ranks).
  auto reduce_group_of = [&](const GroupPtr& shard) {
    const std::string name = shard->name() + "/reduce";
    GroupPtr group = mesh_info.world->find_group(name);
    return group ? group : mesh_info.world->new_group(name, shard->ranks());
  };
  const std::vector<std::string> dims = mesh.dim_names();
  mesh_info.dims = dims;
  if (dims.size() == 1) {
    mesh_info.shard = mesh.group(dims[0]);
    mesh_info.shard_reduce = reduce_group_of(mesh_info.shard);
    // No replicate dimension: a group of this rank alone (no backend, no rendezvous).
    const std::string self = "self/" + std::to_string(mesh_info.world->rank());
    mesh_info.replicate = mesh_info.world->find_group(self);
    if (!mesh_info.replicate)
      mesh_info.replicate = mesh_info.world->new_group(self, {mesh_info.world->rank()});
    mesh_info.data_parallel = mesh_info.shard;
    return mesh_info;
  }
  if (dims.size() != 2) {
    throw std::invalid_argument(
        "fully_shard takes a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard); got " +
        std::to_string(dims.size()) +
        " dimensions: pass the data-parallel part of it, e.g. mesh.slice({\"dp_shard\"}), or "
        "after mesh.flatten({\"dp_shard\", \"cp\"}, \"dp_shard_cp\"), "
        "mesh.slice({\"dp_replicate\", \"dp_shard_cp\"})");
  }
  mesh_info.replicate = mesh.group(dims[0]);
  mesh_info.shard = mesh.group(dims[1]);
  mesh_info.shard_reduce = reduce_group_of(mesh_info.shard);
  // The flattened group is created once per mesh, by every rank in the same order (the
  // first fully_shard with this mesh), like the mesh's own groups.
  const std::string flat = dims[0] + "+" + dims[1];
  mesh_info.data_parallel = mesh.has_group(flat) ? mesh.group(flat) : mesh.flatten(dims, flat);
  return mesh_info;
}

// The states of the subtrees of `roots`, named by module path ("" for a root).
std::vector<detail::LabeledState> states_in_subtree(
    const std::vector<std::weak_ptr<torch::nn::Module>>& roots) {
  std::vector<detail::LabeledState> states;
  for (size_t i = 0; i < roots.size(); ++i) {
    auto root = roots[i].lock();
    if (!root) continue;
    const std::string prefix = roots.size() > 1 ? std::to_string(i) : "";
    for (const auto& item : root->named_modules(prefix, /*include_self=*/true)) {
      auto state = detail::state_of(item.value().get());
      auto same = [&](const detail::LabeledState& s) { return s.second == state; };
      if (state && std::none_of(states.begin(), states.end(), same)) {
        states.emplace_back(item.key(), state);
      }
    }
  }
  return states;
}

// reshard_after_forward: whether to reshard after forward, and for an int k, the group
// of k consecutive shard ranks this rank reshards to.
std::pair<std::optional<bool>, GroupPtr> resolve_reshard_after_forward(
    const std::optional<std::variant<bool, int64_t>>& option,
    const detail::FSDPMeshInfo& mesh_info) {
  if (!option) return {std::nullopt, nullptr};
  if (const bool* flag = std::get_if<bool>(&*option)) return {*flag, nullptr};
  const int64_t k = std::get<int64_t>(*option);
  const Group& shard = *mesh_info.shard;
  if (k <= 0 || shard.size() % k != 0) {
    throw std::invalid_argument(
        "reshard_after_forward=" + std::to_string(k) + " must divide the shard group size " +
        std::to_string(shard.size()) + " (e.g. ranks per node); or pass true / false");
  }
  if (k == 1) return {true, nullptr};
  if (k == shard.size()) return {false, nullptr};
  const int64_t block = shard.rank() / k;
  std::vector<int64_t> ranks(shard.ranks().begin() + block * k,
                             shard.ranks().begin() + (block + 1) * k);
  // Shared by every fully_shard call with this shard group and k.
  const std::string name =
      shard.name() + "/post_forward" + std::to_string(k) + "/" + std::to_string(block);
  GroupPtr group = mesh_info.world->find_group(name);
  if (!group) group = mesh_info.world->new_group(name, std::move(ranks));
  return {true, group};
}

// A tensor on the CPU moves to a GPU mesh device (in place: the variable stays the same);
// a deferred (meta) one keeps its recorded device, anything else stays.
void move_to_mesh_device(const at::Tensor& tensor, c10::Device mesh_device) {
  if (mesh_device.is_cuda() && tensor.device().is_cpu()) {
    c10::NoGradGuard no_grad;
    tensor.set_data(tensor.to(mesh_device));
  }
}

}  // namespace

std::vector<FSDPModule> fully_shard(const std::vector<ShardableModule>& modules,
                                    FullyShardOptions options) {
  if (modules.empty()) throw std::invalid_argument("fully_shard needs at least one module");
  for (const auto& m : modules) {
    if (detail::state_of(m.module().get())) {
      throw std::invalid_argument("fully_shard was already applied to this module (" +
                                  m.module()->name() + "); apply it once per module");
    }
  }
  detail::FSDPMeshInfo mesh_info = resolve_mesh(options.mesh);
  auto [reshard_after_forward, post_forward_group] =
      resolve_reshard_after_forward(options.reshard_after_forward, mesh_info);

  // Parameters a fully_shard-ed submodule manages belong to it, whole subtree included.
  std::set<const c10::TensorImpl*> taken;
  std::vector<std::pair<std::string, at::Tensor>> candidates;
  for (size_t i = 0; i < modules.size(); ++i) {
    const ModulePtr& module = modules[i].module();
    for (const auto& item : module->named_modules("", /*include_self=*/false)) {
      if (!detail::state_of(item.value().get())) continue;
      for (const auto& p : item.value()->parameters()) taken.insert(key(p));
    }
    const std::string prefix = modules.size() > 1 ? std::to_string(i) + "." : "";
    for (const auto& item : module->named_parameters()) {
      candidates.emplace_back(prefix + item.key(), item.value());
    }
  }
  std::set<const c10::TensorImpl*> in_module;
  for (const auto& [name, param] : candidates) in_module.insert(key(param));
  auto check_belongs = [&](const std::vector<at::Tensor>& params, const char* what) {
    std::set<const c10::TensorImpl*> keys;
    for (const auto& p : params) {
      if (!in_module.count(key(p))) {
        throw std::invalid_argument(std::string(what) + ": a tensor of shape " +
                                    c10::str(p.sizes()) +
                                    " is not a parameter of the module(s) given to fully_shard");
      }
      keys.insert(key(p));
    }
    return keys;
  };
  // Parameters another fully_shard call already manages (an ancestor sharded first).
  std::set<const c10::TensorImpl*> managed_elsewhere;
  for (const auto& state : detail::all_states()) {
    for (const auto& p : state->param_group().params())
      managed_elsewhere.insert(key(p->variable()));
    for (const auto& r : state->param_group().replicated())
      managed_elsewhere.insert(key(r.variable));
  }
  for (const auto& [name, param] : candidates) {
    if (!taken.count(key(param)) && managed_elsewhere.count(key(param))) {
      throw std::invalid_argument("parameter '" + name +
                                  "' is already managed by another fully_shard call (of an "
                                  "ancestor?); apply fully_shard to submodules first, then to "
                                  "their ancestors");
    }
  }
  const auto ignored = check_belongs(options.ignored_params, "ignored_params");
  const auto replicated = check_belongs(options.replicate_params, "replicate_params");
  // A parallel slice differs across the ranks of its group: sharding or reducing it over
  // two of them would mix different tensors.
  for (const auto& [name, param] : candidates) {
    if (taken.count(key(param)) || ignored.count(key(param))) continue;
    const std::optional<ParallelSlice> slice = parallel_slice_of(param);
    if (!slice) continue;
    const std::vector<int64_t>& holders = slice->group->ranks();
    const auto shared = std::count_if(
        mesh_info.data_parallel->ranks().begin(), mesh_info.data_parallel->ranks().end(),
        [&](int64_t r) { return std::find(holders.begin(), holders.end(), r) != holders.end(); });
    if (shared > 1) {
      throw std::invalid_argument(
          "parameter '" + name + "' is a parallel slice over group '" + slice->group->name() +
          "', and " + std::to_string(shared) +
          " ranks of that group, holding different slices, are in the mesh given to "
          "fully_shard; shard it over the data-parallel dims orthogonal to that group (e.g. "
          "mesh.slice({\"dp_shard\"})), fully_shard-ing the module that owns it first");
    }
  }

  detail::ParamPolicy policy;
  policy.param_dtype = options.mp_policy.param_dtype;
  policy.reduce_dtype = options.mp_policy.reduce_dtype;
  policy.fp32_main_grad = options.mp_policy.apply_grad_on_fp32_main_grad;
  policy.offload = options.offload_policy.offload;
  policy.pin_memory = options.offload_policy.pin_memory;
  policy.mesh_device = mesh_info.world->device();

  std::vector<std::unique_ptr<detail::FSDPParam>> sharded;
  std::vector<detail::ReplicatedParam> replicas;
  std::set<const c10::TensorImpl*> seen;  // a tied parameter is managed once
  for (const auto& [name, param] : candidates) {
    if (taken.count(key(param)) || ignored.count(key(param)) || !seen.insert(key(param)).second) {
      continue;
    }
    std::optional<Placement> placement;
    if (options.shard_placement_fn) placement = options.shard_placement_fn(name, param);
    if (replicated.count(key(param)) || param.dim() == 0) {
      placement = Placement::replicate();  // scalars cannot be split
    }
    if (!placement) placement = Placement::shard(0);
    if (placement->is_replicate()) {
      replicas.push_back(detail::ReplicatedParam{name, param, {}, {}});
      continue;
    }
    const int64_t dim = placement->dim() < 0 ? placement->dim() + param.dim() : placement->dim();
    if (dim < 0 || dim >= param.dim()) {
      throw std::invalid_argument("shard_placement_fn returned " + placement->str() + " for '" +
                                  name + "' of shape " + c10::str(param.sizes()) +
                                  "; the shard dim must be in [0, " + std::to_string(param.dim()) +
                                  ")");
    }
    sharded.push_back(std::make_unique<detail::FSDPParam>(name, param, dim, mesh_info.shard->size(),
                                                          mesh_info.shard->rank(), policy));
  }

  // The rest of the module's states follow the sharded parameters to a GPU mesh's device
  // (FSDP2's move of module states); ignored parameters stay where they are.
  for (auto& replica : replicas) move_to_mesh_device(replica.variable, policy.mesh_device);
  for (const auto& m : modules) {
    for (const auto& buffer : m.module()->buffers())
      move_to_mesh_device(buffer, policy.mesh_device);
  }

  auto param_group = std::make_unique<detail::FSDPParamGroup>(
      std::move(sharded), std::move(replicas), mesh_info, options.comm_fusion);
  param_group->set_post_forward_group(post_forward_group);
  std::vector<std::weak_ptr<torch::nn::Module>> roots;
  for (const auto& m : modules) roots.push_back(m.module());
  auto state =
      std::make_shared<FSDPState>(std::move(param_group), options.mp_policy, reshard_after_forward,
                                  [roots] { return states_in_subtree(roots); });
  std::vector<FSDPModule> result;
  for (const auto& m : modules) {
    detail::register_state(m.module(), state);
    result.emplace_back(state);
  }
  return result;
}

FSDPModule fully_shard(ShardableModule module, FullyShardOptions options) {
  return fully_shard(std::vector<ShardableModule>{std::move(module)}, std::move(options)).front();
}

}  // namespace hp
