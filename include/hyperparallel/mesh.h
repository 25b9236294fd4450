#pragma once
// A named N-D mesh of ranks, e.g. {{"dp_replicate", 2}, {"dp_shard", 2}} over 4 ranks.
// Ranks are laid out row-major (the last dimension varies fastest). The mesh creates one
// process group per dimension — the ranks that differ only in that coordinate — and, on
// request, one per flattened set of dimensions (e.g. "dp" = replicate x shard).
//
// A flattened set of dimensions can itself be a dimension of a sub-mesh: after
// flatten({"dp_shard", "cp"}, "dp_shard_cp"), slice({"dp_replicate", "dp_shard_cp"}) is a
// 2-D mesh whose second dimension spans both (the FSDP shard group of torchtitan's
// dp_shard x cp).
//
// Group creation is a rendezvous: every rank constructs the same meshes and calls
// flatten() with the same arguments, in the same order.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hyperparallel/process_group.h"

namespace hp {

struct MeshDim {
  std::string name;
  int64_t size;
};

class DeviceMesh {
 public:
  // A mesh over all ranks of `world`: the product of the sizes must equal world->size().
  DeviceMesh(std::shared_ptr<World> world, std::vector<MeshDim> dims);

  // Joins the world from the launch environment, then builds the mesh.
  static DeviceMesh from_env(std::vector<MeshDim> dims, WorldOptions options = {});

  const std::shared_ptr<World>& world() const;
  int64_t ndim() const;
  std::vector<std::string> dim_names() const;
  int64_t size() const;  // number of ranks in this (sub-)mesh
  // `dim` is a mesh dimension or a flattened name (its coordinate is row-major over the
  // dimensions it spans, equal to this rank's rank in its group).
  int64_t size(const std::string& dim) const;
  int64_t coordinate(const std::string& dim) const;  // this rank's index along `dim`
  int64_t global_rank() const;

  // `dim` is a mesh dimension or a flattened name. Global ranks of this rank's group.
  std::vector<int64_t> group_ranks(const std::string& dim) const;
  const GroupPtr& group(const std::string& dim) const;
  bool has_group(const std::string& dim) const;

  // Creates the group over `dims` (in mesh order) under `name`; returns it.
  const GroupPtr& flatten(const std::vector<std::string>& dims, const std::string& name);

  // The sub-mesh of this rank over `dims` (mesh dimensions or flattened names that share
  // no dimension; kept in mesh order). It shares the parent's groups, including flattened
  // groups made only of the dimensions it spans.
  DeviceMesh slice(const std::vector<std::string>& dims) const;

 private:
  struct Layout;
  DeviceMesh(std::shared_ptr<Layout> layout, std::vector<std::string> kept);
  const std::vector<size_t>& span_of(const std::string& dim) const;  // its root dims
  std::vector<size_t> spans_of(const std::vector<std::string>& dims, const char* operation) const;
  bool spans_kept_dims(const std::vector<size_t>& span) const;

  std::shared_ptr<Layout> layout_;  // the root mesh's dims and groups
  std::vector<std::string> kept_;   // this (sub-)mesh's dims: root dims or flattened names
};

}  // namespace hp
