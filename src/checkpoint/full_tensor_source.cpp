#include "full_tensor_source.h"

#include <c10/util/Exception.h>

#include "torch_save_reader.h"

namespace hp::detail {

FullTensorSource source_of(const StateDict& state) {
  FullTensorSource source;
  source.description = "the state dict";
  source.names = state.keys();
  source.shape_of = [&state](const std::string& name) -> std::optional<c10::IntArrayRef> {
    const at::Tensor* found = state.find(name);
    if (!found) return std::nullopt;
    return found->sizes();
  };
  source.read = [&state](const std::string& name) { return state[name]; };
  return source;
}

FullTensorSource source_of(TorchSaveReader& reader) {
  FullTensorSource source;
  source.description = "checkpoint file " + reader.path();
  for (const auto& entry : reader.entries()) source.names.push_back(entry.name);
  source.shape_of = [&reader](const std::string& name) -> std::optional<c10::IntArrayRef> {
    const TorchSaveReader::Entry* entry = reader.find(name);
    if (!entry) return std::nullopt;
    return c10::IntArrayRef(entry->shape);
  };
  source.read = [&reader](const std::string& name) { return reader.read(*reader.find(name)); };
  return source;
}

at::Tensor read_local_part(const FullTensorSource& source, const std::string& name,
                           const ModelParam& param) {
  if (!param.shard) return slice_of_whole(param, source.read(name));
  const int64_t dim = param.shard->shard_dim();
  const int64_t start = param.shard->shard_offset();
  const int64_t length = param.shard->local().size(dim);
  if (param.parallel_slice) {  // the shard is a part of this rank's slice
    return slice_of_whole(param, source.read(name)).narrow(dim, start, length);
  }
  if (source.read_part) return source.read_part(name, dim, start, length);
  return source.read(name).narrow(dim, start, length);
}

void require_all_used(const FullTensorSource& source, const std::set<std::string>& used,
                      bool strict, const std::string& caller, const std::string& not_what) {
  if (!strict) return;
  for (const auto& name : source.names) {
    if (!used.count(name)) {
      C10_THROW_ERROR(ValueError, caller + ": '" + name + "' is " + not_what + ", but " +
                                      source.description +
                                      " has it (strict; pass strict = false to skip such entries)");
    }
  }
}

}  // namespace hp::detail
