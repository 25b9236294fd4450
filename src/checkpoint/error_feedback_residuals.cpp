// Error-feedback residuals in sharded checkpoints: one row per rank holding the parameter.
#include "error_feedback_residuals.h"

#include <c10/util/Exception.h>

#include <set>

#include "hyperparallel/process_group.h"

namespace hp::detail {
namespace {

// This rank's row of `p`'s residual entry, and how many rows it has.
struct ResidualRow {
  int64_t row = 0;
  int64_t rows = 1;
};

ResidualRow residual_row(const ModelParam& p) {
  const Group& data_parallel = p.shard->data_parallel_group();
  ResidualRow r{data_parallel.rank(), data_parallel.size()};
  if (p.parallel_slice) {
    const Group& slice = *p.parallel_slice->group;
    r.row += slice.rank() * r.rows;
    r.rows *= slice.size();
  }
  return r;
}

// The entry's whole shape: [rows, shard ranks, padded shard size].
std::vector<int64_t> whole_shape(const ModelParam& p, const std::vector<int64_t>& residual_shape) {
  std::vector<int64_t> shape = {residual_row(p).rows};
  shape.insert(shape.end(), residual_shape.begin(), residual_shape.end());
  return shape;
}

}  // namespace

std::vector<RankPiece> error_feedback_residual_pieces(const std::vector<ModelParam>& params) {
  std::vector<RankPiece> pieces;
  for (const auto& p : params) {
    if (!p.shard) continue;
    const at::Tensor residual = p.shard->error_feedback_residual();
    if (!residual.defined()) continue;
    std::vector<int64_t> offsets(residual.dim() + 1, 0);
    offsets[0] = residual_row(p).row;
    pieces.push_back({p.name, residual.detach().unsqueeze(0), std::move(offsets),
                      whole_shape(p, residual.sizes().vec())});
  }
  return pieces;
}

std::set<std::string> error_feedback_residual_entries(const std::vector<ModelParam>& params,
                                                      const FullTensorSource& source) {
  std::set<std::string> used;
  for (const auto& p : params) {
    if (p.shard && !p.shard->error_feedback_residual_shape().empty() && source.shape_of(p.name)) {
      used.insert(p.name);
    }
  }
  return used;
}

void load_error_feedback_residuals(const std::vector<ModelParam>& params,
                                   const FullTensorSource& source, const std::string& caller) {
  std::vector<std::string> other_mesh;
  for (const auto& p : params) {
    if (!p.shard) continue;
    const std::vector<int64_t> shape = p.shard->error_feedback_residual_shape();
    if (shape.empty()) continue;
    const std::optional<c10::IntArrayRef> saved = source.shape_of(p.name);
    at::Tensor residual;  // zeros unless the checkpoint has this mesh's
    if (saved) {
      const std::vector<int64_t> expected = whole_shape(p, shape);
      if (*saved == c10::IntArrayRef(expected)) {
        residual = source.read_part(p.name, 0, residual_row(p).row, 1).squeeze(0);
      } else {
        other_mesh.push_back("'" + p.name + "' saved " + c10::str(*saved) + ", here " +
                             c10::str(c10::IntArrayRef(expected)));
      }
    }
    p.shard->set_error_feedback_residual(residual);
  }
  if (!other_mesh.empty()) {
    TORCH_WARN(caller, ": the error-feedback residuals in ", source.description,
               " were saved on another mesh, so ", other_mesh.size(), " of them start from zero (",
               other_mesh.front(), ")");
  }
}

void warn_unused_error_feedback_residuals(const FullTensorSource& source,
                                          const std::set<std::string>& used,
                                          const std::string& caller) {
  for (const auto& name : source.names) {
    if (!used.contains(name)) {
      TORCH_WARN(caller, ": ", source.description,
                 " holds error-feedback residuals that this "
                 "model does not keep (of '",
                 name, "', for one; CommPolicy::error_feedback is off there): ignored");
      break;
    }
  }
}

}  // namespace hp::detail
