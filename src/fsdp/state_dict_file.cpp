// State dict files in PyTorch's torch.save format: a zip archive with the pickled dict
// and one record per tensor, pickled without TorchScript type tags so that Python's
// torch.load reads it with its default weights_only=True.
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fstream>
#include <iterator>
#include <stdexcept>

#include "hyperparallel/state_dict.h"

namespace hp {

void write_state_dict_file(const StateDict& state, const std::string& path) {
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
  std::ofstream file(path, std::ios::binary);
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    file.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
    return file ? size : 0;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  if (!file.flush()) throw std::runtime_error("write_state_dict_file: cannot write " + path);
}

StateDict read_state_dict_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::invalid_argument("read_state_dict_file: cannot open " + path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)),
                                std::istreambuf_iterator<char>());
  const c10::IValue value = torch::jit::pickle_load(bytes);
  if (!value.isGenericDict()) {
    throw std::invalid_argument("read_state_dict_file: " + path +
                                " does not hold a dict of tensors (a state dict)");
  }
  StateDict state;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      throw std::invalid_argument("read_state_dict_file: " + path +
                                  " holds a dict entry that is not name -> tensor");
    }
    state.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return state;
}

}  // namespace hp
