#include "hyperparallel/mesh.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>

namespace hp {

struct DeviceMesh::Layout {
  std::shared_ptr<World> world;
  std::vector<MeshDim> dims;
  std::vector<int64_t> coords;  // this rank's coordinates
  int64_t id = 0;
  std::map<std::string, std::vector<size_t>> group_dims;  // group name -> root dims
  std::map<std::string, GroupPtr> groups;

  std::string describe() const {
    std::string text = "{";
    for (const auto& d : dims) {
      text += (text.size() > 1 ? ", " : "") + d.name + ": " + std::to_string(d.size);
    }
    return text + "}";
  }

  // Global ranks that share this rank's coordinates outside `span`, ascending.
  std::vector<int64_t> ranks_varying(const std::vector<size_t>& span) const {
    std::vector<int64_t> ranks{0};
    for (size_t i = 0; i < dims.size(); ++i) {
      const bool varies = std::find(span.begin(), span.end(), i) != span.end();
      std::vector<int64_t> next;
      for (int64_t r : ranks) {
        if (!varies) {
          next.push_back(r * dims[i].size + coords[i]);
          continue;
        }
        for (int64_t c = 0; c < dims[i].size; ++c) next.push_back(r * dims[i].size + c);
      }
      ranks = std::move(next);
    }
    return ranks;
  }

  const GroupPtr& make_group(const std::string& name, const std::vector<size_t>& span) {
    std::vector<int64_t> ranks = ranks_varying(span);
    std::string unique =
        "mesh" + std::to_string(id) + "/" + name + "/" + std::to_string(ranks.front());
    group_dims[name] = span;
    return groups[name] = world->new_group(unique, std::move(ranks));
  }
};

DeviceMesh::DeviceMesh(std::shared_ptr<World> world, std::vector<MeshDim> dims) {
  if (!world) C10_THROW_ERROR(ValueError, "DeviceMesh needs a World");
  if (dims.empty()) C10_THROW_ERROR(ValueError, "DeviceMesh needs at least one dimension");
  auto layout = std::make_shared<Layout>();
  layout->world = world;
  layout->dims = dims;
  std::set<std::string> names;
  int64_t product = 1;
  for (const auto& d : dims) {
    if (d.name.empty()) C10_THROW_ERROR(ValueError, "mesh dimension names must not be empty");
    if (!names.insert(d.name).second) {
      C10_THROW_ERROR(ValueError, "mesh dimension '" + d.name + "' appears twice in " +
                                      layout->describe() + "; give each dimension its own name");
    }
    if (d.size <= 0) {
      C10_THROW_ERROR(ValueError, "mesh dimension '" + d.name + "' has size " +
                                      std::to_string(d.size) + "; sizes must be positive");
    }
    product *= d.size;
  }
  if (product != world->size()) {
    C10_THROW_ERROR(ValueError, "mesh " + layout->describe() + " has " + std::to_string(product) +
                                    " ranks but the world has " + std::to_string(world->size()) +
                                    "; make the product of the sizes equal WORLD_SIZE");
  }
  int64_t rest = world->rank();
  layout->coords.resize(dims.size());
  for (size_t i = dims.size(); i-- > 0;) {
    layout->coords[i] = rest % dims[i].size;
    rest /= dims[i].size;
  }
  layout->id = world->next_mesh_id();
  for (size_t i = 0; i < dims.size(); ++i) layout->make_group(dims[i].name, {i});
  layout_ = std::move(layout);
  for (const auto& d : dims) kept_.push_back(d.name);
}

DeviceMesh::DeviceMesh(std::shared_ptr<Layout> layout, std::vector<std::string> kept)
    : layout_(std::move(layout)), kept_(std::move(kept)) {}

DeviceMesh DeviceMesh::from_env(std::vector<MeshDim> dims, WorldOptions options) {
  return DeviceMesh(World::from_env(options), std::move(dims));
}

const std::shared_ptr<World>& DeviceMesh::world() const { return layout_->world; }

int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(kept_.size()); }

std::vector<std::string> DeviceMesh::dim_names() const { return kept_; }

int64_t DeviceMesh::size() const {
  int64_t product = 1;
  for (const auto& dim : kept_) product *= size(dim);
  return product;
}

// A dim of this mesh, or a flattened group of its dims (which acts as one dim).
const std::vector<size_t>& DeviceMesh::span_of(const std::string& dim) const {
  if (has_group(dim)) return layout_->group_dims.at(dim);
  std::string known;
  for (const auto& name : kept_) known += (known.empty() ? "" : ", ") + name;
  C10_THROW_ERROR(ValueError, "mesh has no dimension '" + dim + "' (it has: " + known + ")");
}

int64_t DeviceMesh::size(const std::string& dim) const {
  int64_t product = 1;
  for (size_t i : span_of(dim)) product *= layout_->dims[i].size;
  return product;
}

int64_t DeviceMesh::coordinate(const std::string& dim) const {
  int64_t coordinate = 0;  // row-major over the dims it spans, as its group's ranks are
  for (size_t i : span_of(dim))
    coordinate = coordinate * layout_->dims[i].size + layout_->coords[i];
  return coordinate;
}

int64_t DeviceMesh::global_rank() const { return layout_->world->rank(); }

bool DeviceMesh::spans_kept_dims(const std::vector<size_t>& span) const {
  // A group belongs to this (sub-)mesh when all the root dims it spans are kept.
  return std::all_of(span.begin(), span.end(), [&](size_t i) {
    return std::any_of(kept_.begin(), kept_.end(), [&](const std::string& dim) {
      const auto& kept_span = layout_->group_dims.at(dim);
      return std::find(kept_span.begin(), kept_span.end(), i) != kept_span.end();
    });
  });
}

bool DeviceMesh::has_group(const std::string& dim) const {
  auto found = layout_->group_dims.find(dim);
  return found != layout_->group_dims.end() && spans_kept_dims(found->second);
}

const GroupPtr& DeviceMesh::group(const std::string& dim) const {
  if (has_group(dim)) return layout_->groups.at(dim);
  std::string known;
  for (const auto& [name, span] : layout_->group_dims) {
    if (spans_kept_dims(span)) known += (known.empty() ? "" : ", ") + name;
  }
  C10_THROW_ERROR(ValueError,
                  "mesh has no dimension or flattened group '" + dim + "' (it has: " + known + ")");
}

std::vector<int64_t> DeviceMesh::group_ranks(const std::string& dim) const {
  return group(dim)->ranks();
}

// The root dims that `dims` (dims of this mesh) span together, ascending; throws if two
// of them share a root dim.
std::vector<size_t> DeviceMesh::spans_of(const std::vector<std::string>& dims,
                                         const char* operation) const {
  std::vector<size_t> span;
  for (const auto& d : dims) {
    const auto& part = span_of(d);
    span.insert(span.end(), part.begin(), part.end());
  }
  std::sort(span.begin(), span.end());
  if (std::adjacent_find(span.begin(), span.end()) != span.end()) {
    C10_THROW_ERROR(ValueError, std::string(operation) +
                                    ": a dimension is listed twice (directly or inside a "
                                    "flattened one)");
  }
  return span;
}

const GroupPtr& DeviceMesh::flatten(const std::vector<std::string>& dims, const std::string& name) {
  if (dims.empty()) C10_THROW_ERROR(ValueError, "flatten needs at least one dimension");
  if (name.empty()) C10_THROW_ERROR(ValueError, "flatten needs a non-empty name");
  if (layout_->group_dims.count(name)) {
    C10_THROW_ERROR(ValueError, "flatten: the name '" + name + "' is already used by this mesh");
  }
  return layout_->make_group(name, spans_of(dims, ("flatten '" + name + "'").c_str()));
}

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& dims) const {
  if (dims.empty()) C10_THROW_ERROR(ValueError, "slice needs at least one dimension");
  spans_of(dims, "slice");
  std::vector<std::string> kept = dims;
  // Mesh order: by the first root dim each one spans.
  std::sort(kept.begin(), kept.end(), [&](const std::string& a, const std::string& b) {
    return span_of(a).front() < span_of(b).front();
  });
  return DeviceMesh(layout_, std::move(kept));
}

}  // namespace hp
