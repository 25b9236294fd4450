#pragma once
// Error-feedback residuals (CommPolicy::error_feedback) in sharded checkpoints. Each rank
// keeps its own residual per parameter, so the entry "error_feedback/<parameter name>" has
// one row per rank holding the parameter (its data-parallel ranks, times its parallel
// slice's ranks) and each rank writes and reads its own row. A residual only means
// something on the mesh that made it: loaded elsewhere it starts from zero, with a warning.

#include <set>
#include <string>
#include <vector>

#include "../materialize/model_params.h"
#include "checkpoint_writing.h"
#include "full_tensor_source.h"

namespace hp::detail {

// This rank's residuals of `params`, named without the prefix (none before the first
// reduction, which equals zeros).
std::vector<RankPiece> error_feedback_residual_pieces(const std::vector<ModelParam>& params);

// The entries of `source` (named without the prefix) that load_error_feedback_residuals
// reads for `params`: those of the parameters with error feedback.
std::set<std::string> error_feedback_residual_entries(const std::vector<ModelParam>& params,
                                                      const FullTensorSource& source);

// Sets the residual of every parameter with error feedback from `source`, zeros where it
// has none. Warns (TORCH_WARN, naming `caller`) when the residuals were saved on another
// mesh; they are then left out.
void load_error_feedback_residuals(const std::vector<ModelParam>& params,
                                   const FullTensorSource& source, const std::string& caller);

// Warns once when `source` holds residuals that are not in `used` (of parameters without
// error feedback on every rank): they are ignored.
void warn_unused_error_feedback_residuals(const FullTensorSource& source,
                                          const std::set<std::string>& used,
                                          const std::string& caller);

}  // namespace hp::detail
