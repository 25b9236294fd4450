#include "state_dict_file.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <stdexcept>

namespace hp::detail {

std::vector<char> state_dict_to_bytes(const StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) dict.insert(item.key(), item.value());
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickled.insert(pickled.end(), data, data + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return archive;
}

StateDict state_dict_from_bytes(const std::vector<char>& bytes, const std::string& origin) {
  const c10::IValue value = torch::jit::pickle_load(bytes);
  if (!value.isGenericDict()) {
    throw std::invalid_argument(origin + " does not hold a dict of tensors (a state dict)");
  }
  StateDict state;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      throw std::invalid_argument(origin + " holds a dict entry that is not name -> tensor");
    }
    state.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return state;
}

}  // namespace hp::detail
