#pragma once
// The bytes of a checkpoint file: PyTorch's torch.save format (a zip archive with the
// pickled dict and one record per tensor), written without TorchScript type tags so that
// Python's torch.load reads it with its default weights_only=True.

#include <string>
#include <vector>

#include "hyperparallel/state_dict.h"

namespace hp::detail {

std::vector<char> state_dict_to_bytes(const StateDict& state);
// `origin` names the source in errors (a path).
StateDict state_dict_from_bytes(const std::vector<char>& bytes, const std::string& origin);

}  // namespace hp::detail
