// Whole state dicts as torch.save files, through the same one-tensor-at-a-time reader and
// writer that the streaming checkpoints use.
#include "hyperparallel/state_dict.h"
#include "torch_save_reader.h"
#include "torch_save_writer.h"

namespace hp {

void write_state_dict_file(const StateDict& state, const std::string& path) {
  detail::TorchSaveWriter writer(path);
  for (const auto& item : state) writer.write(item.key(), item.value());
  writer.finish();
}

StateDict read_state_dict_file(const std::string& path) {
  detail::TorchSaveReader reader(path);
  StateDict state;
  for (const auto& entry : reader.entries()) state.insert(entry.name, reader.read(entry));
  return state;
}

}  // namespace hp
