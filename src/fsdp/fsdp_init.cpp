// fully_shard()'s decisions before it builds a state: mesh groups, reshard after forward,
// the managed parameters and their placements.
#include "fsdp_init.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>

#include "hyperparallel/parallel_slice.h"
#include "state_registry.h"

namespace hp::detail {
namespace {

const c10::TensorImpl* key(const at::Tensor& tensor) { return tensor.unsafeGetTensorImpl(); }

DeviceMesh default_mesh() {
  static DeviceMesh mesh(default_world(), {{"dp_shard", default_world()->size()}});
  return mesh;
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

FSDPMeshInfo resolve_mesh(const std::optional<DeviceMesh>& requested) {
  DeviceMesh mesh = requested ? *requested : default_mesh();
  FSDPMeshInfo mesh_info;
  mesh_info.world = mesh.world();
  mesh_info.device = mesh.world()->device();
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
    C10_THROW_ERROR(
        ValueError,
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

std::vector<LabeledState> states_in_subtree(
    const std::vector<std::weak_ptr<torch::nn::Module>>& roots) {
  std::vector<LabeledState> states;
  for (size_t i = 0; i < roots.size(); ++i) {
    auto root = roots[i].lock();
    if (!root) continue;
    const std::string prefix = roots.size() > 1 ? std::to_string(i) : "";
    for (const auto& item : root->named_modules(prefix, /*include_self=*/true)) {
      auto state = state_of(item.value().get());
      auto same = [&](const LabeledState& s) { return s.second == state; };
      if (state && std::none_of(states.begin(), states.end(), same)) {
        states.emplace_back(item.key(), state);
      }
    }
  }
  return states;
}

std::pair<std::optional<bool>, GroupPtr> resolve_reshard_after_forward(
    const std::optional<std::variant<bool, int64_t>>& option, const FSDPMeshInfo& mesh_info) {
  if (!option) return {std::nullopt, nullptr};
  if (const bool* flag = std::get_if<bool>(&*option)) return {*flag, nullptr};
  const int64_t k = std::get<int64_t>(*option);
  const Group& shard = *mesh_info.shard;
  if (k <= 0 || shard.size() % k != 0) {
    C10_THROW_ERROR(ValueError, "reshard_after_forward=" + std::to_string(k) +
                                    " must divide the shard group size " +
                                    std::to_string(shard.size()) +
                                    " (e.g. ranks per node); or pass true / false");
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

namespace {

using Keys = std::set<const c10::TensorImpl*>;
using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

// The keys of `params` (ignored_params or replicate_params), each a candidate.
Keys keys_of_candidates(const std::vector<at::Tensor>& params, const NamedParams& candidates,
                        const char* what) {
  Keys in_module;
  for (const auto& [name, param] : candidates) in_module.insert(key(param));
  Keys keys;
  for (const auto& p : params) {
    TORCH_CHECK_VALUE(in_module.count(key(p)), what, ": a tensor of shape ", c10::str(p.sizes()),
                      " is not a parameter of the module(s) given to fully_shard");
    keys.insert(key(p));
  }
  return keys;
}

// Parameters another fully_shard call already manages (an ancestor sharded first).
void check_not_managed_elsewhere(const NamedParams& candidates, const Keys& taken,
                                 const std::vector<StatePtr>& existing) {
  Keys managed_elsewhere;
  for (const auto& state : existing) {
    for (const auto& p : state->param_group().params())
      managed_elsewhere.insert(key(p->variable()));
    for (const auto& r : state->param_group().replicated())
      managed_elsewhere.insert(key(r.variable));
  }
  for (const auto& [name, param] : candidates) {
    TORCH_CHECK_VALUE(taken.count(key(param)) || !managed_elsewhere.count(key(param)),
                      "parameter '", name,
                      "' is already managed by another fully_shard call: an ancestor's "
                      "(apply fully_shard to submodules first, then to their ancestors) or "
                      "one whose module shares it (tied weights: fully_shard the modules "
                      "sharing a parameter together, or their common ancestor)");
  }
}

// A parallel slice differs across the ranks of its group: sharding or reducing it over
// two of them would mix different tensors.
void check_parallel_slices(const NamedParams& candidates, const Keys& skipped,
                           const FSDPMeshInfo& mesh_info) {
  const std::vector<int64_t>& mesh_ranks = mesh_info.data_parallel->ranks();
  for (const auto& [name, param] : candidates) {
    if (skipped.count(key(param))) continue;
    const std::optional<ParallelSlice> slice = parallel_slice_of(param);
    if (!slice) continue;
    const std::vector<int64_t>& holders = slice->group->ranks();
    const auto shared = std::count_if(mesh_ranks.begin(), mesh_ranks.end(), [&](int64_t r) {
      return std::find(holders.begin(), holders.end(), r) != holders.end();
    });
    TORCH_CHECK_VALUE(
        shared <= 1, "parameter '", name, "' is a parallel slice over group '",
        slice->group->name(), "', and ", std::to_string(shared),
        " ranks of that group, holding different slices, are in the mesh given to "
        "fully_shard; shard it over the data-parallel dims orthogonal to that group (e.g. "
        "mesh.slice({\"dp_shard\"})), fully_shard-ing the module that owns it first");
  }
}

ParamPolicy param_policy(const FullyShardOptions& options, const FSDPMeshInfo& mesh_info) {
  ParamPolicy policy;
  policy.param_dtype = options.mp_policy.param_dtype;
  policy.reduce_dtype = options.mp_policy.reduce_dtype;
  policy.fp32_main_grad = options.mp_policy.apply_grad_on_fp32_main_grad;
  policy.offload = options.offload_policy.offload;
  policy.pin_memory = options.offload_policy.pin_memory;
  policy.mesh_device = mesh_info.device;
  policy.shard_group_communicates = mesh_info.shard->communicates();
  return policy;
}

// Where `param` goes: shard_placement_fn's answer, Replicate() for replicate_params and
// scalars (they cannot be split), else Shard(0); a shard dim made non-negative.
Placement placement_of(const std::string& name, const at::Tensor& param, bool replicated,
                       const FullyShardOptions& options) {
  std::optional<Placement> placement;
  if (options.shard_placement_fn) placement = options.shard_placement_fn(name, param);
  if (replicated || param.dim() == 0) return Placement::replicate();
  if (!placement) return Placement::shard(0);
  if (placement->is_replicate()) return *placement;
  const int64_t dim = placement->dim() < 0 ? placement->dim() + param.dim() : placement->dim();
  TORCH_CHECK_VALUE(dim >= 0 && dim < param.dim(), "shard_placement_fn returned ", placement->str(),
                    " for '", name, "' of shape ", c10::str(param.sizes()),
                    "; the shard dim must be in [0, ", std::to_string(param.dim()), ")");
  return Placement::shard(dim);
}

void check_options(const FullyShardOptions& options) {
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
}

}  // namespace

CandidateParams candidate_params(const std::vector<ModulePtr>& modules) {
  CandidateParams candidates;
  for (size_t i = 0; i < modules.size(); ++i) {
    for (const auto& item : modules[i]->named_modules("", /*include_self=*/false)) {
      if (!state_of(item.value().get())) continue;
      for (const auto& p : item.value()->parameters()) candidates.taken.insert(key(p));
    }
    const std::string prefix = modules.size() > 1 ? std::to_string(i) + "." : "";
    for (const auto& item : modules[i]->named_parameters()) {
      candidates.named.emplace_back(prefix + item.key(), item.value());
    }
  }
  return candidates;
}

ManagedParams managed_params(const CandidateParams& candidates, const FullyShardOptions& options,
                             const FSDPMeshInfo& mesh_info, const std::vector<StatePtr>& existing) {
  const NamedParams& named = candidates.named;
  check_not_managed_elsewhere(named, candidates.taken, existing);
  const Keys ignored = keys_of_candidates(options.ignored_params, named, "ignored_params");
  const Keys replicated = keys_of_candidates(options.replicate_params, named, "replicate_params");
  Keys skipped = candidates.taken;
  skipped.insert(ignored.begin(), ignored.end());
  check_parallel_slices(named, skipped, mesh_info);

  // Every placement is checked before the first parameter is sharded.
  std::vector<std::tuple<std::string, at::Tensor, Placement>> placed;
  Keys seen;  // a tied parameter is managed once
  for (const auto& [name, param] : named) {
    if (skipped.count(key(param)) || !seen.insert(key(param)).second) continue;
    placed.emplace_back(name, param,
                        placement_of(name, param, replicated.count(key(param)), options));
  }
  ParamPolicy policy = param_policy(options, mesh_info);
  policy.meta_moved_by_front_end = candidates.meta_moved_by_front_end;
  ManagedParams managed;
  for (const auto& [name, param, placement] : placed) {
    if (placement.is_replicate()) {
      managed.replicated.emplace_back(name, param, policy);
    } else {
      managed.sharded.push_back(std::make_unique<FSDPParam>(
          name, param, placement.dim(), mesh_info.shard->size(), mesh_info.shard->rank(), policy));
    }
  }
  return managed;
}

StatePtr build_state(const CandidateParams& candidates, const FullyShardOptions& options,
                     const FSDPMeshInfo& mesh_info,
                     std::pair<std::optional<bool>, GroupPtr> reshard_after_forward,
                     const std::vector<StatePtr>& existing,
                     std::function<std::vector<LabeledState>()> subtree) {
  check_options(options);
  ManagedParams managed = managed_params(candidates, options, mesh_info, existing);
  for (auto& replica : managed.replicated) move_to_mesh_device(replica.variable, mesh_info.device);
  auto param_group = std::make_unique<FSDPParamGroup>(
      std::move(managed.sharded), std::move(managed.replicated), mesh_info,
      CommFusion{options.comm_fusion, options.comm_fusion_bucket_bytes}, options.comm_policy);
  param_group->set_post_forward_group(std::move(reshard_after_forward.second));
  return std::make_shared<FSDPState>(std::move(param_group), options.mp_policy,
                                     reshard_after_forward.first, std::move(subtree));
}

void move_buffers_to_mesh_device(const std::vector<ModulePtr>& modules, c10::Device device) {
  for (const auto& module : modules) {
    for (const auto& buffer : module->buffers()) move_to_mesh_device(buffer, device);
  }
}

}  // namespace hp::detail
