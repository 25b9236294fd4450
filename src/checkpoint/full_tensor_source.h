#pragma once
// Whole tensors by name for the functions that load them into a model or an optimizer:
// a state dict in memory, or a checkpoint file read one tensor at a time. Shapes come
// first, so that everything is checked before anything changes; each tensor is then
// read when it is loaded.

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../materialize/model_params.h"
#include "hyperparallel/state_dict.h"

namespace hp::detail {

class TorchSaveReader;

struct FullTensorSource {
  std::string description;  // for messages: "the state dict", "checkpoint file <path>"
  std::vector<std::string> names;
  // Unset when there is no tensor of that name.
  std::function<std::optional<c10::IntArrayRef>(const std::string&)> shape_of;
  // The whole tensor of a name that shape_of knows; may share memory with the source.
  std::function<at::Tensor(const std::string&)> read;
  // The slice [start, start + length) along `dim` of a tensor, reading only what it needs;
  // unset: the slice of read(name).
  std::function<at::Tensor(const std::string&, int64_t dim, int64_t start, int64_t length)>
      read_part;
};

// This rank's part of entry `name` (shaped like the whole parameter) for `param`: its
// local shard's part of its tensor-parallel slice (either may be the whole).
at::Tensor read_local_part(const FullTensorSource& source, const std::string& name,
                           const ModelParam& param);

// Both refer to their argument, which must outlive the source.
FullTensorSource source_of(const StateDict& state);
FullTensorSource source_of(TorchSaveReader& reader);

// Strict: throws c10::ValueError naming `caller` and the first name of `source`
// that is not in `used`, which "is <not_what>".
void require_all_used(const FullTensorSource& source, const std::set<std::string>& used,
                      bool strict, const std::string& caller, const std::string& not_what);

}  // namespace hp::detail
