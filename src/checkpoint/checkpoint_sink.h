#pragma once
// The file a full checkpoint streams into, on the rank that writes it (see
// writes_whole_tensors). The other ranks gather the same tensors and drop them.
//
// A write error is kept and thrown by finish(), after the save's collectives have run:
// throwing at once would leave the other ranks waiting in the next gather.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "torch_save_writer.h"

namespace hp::detail {

class CheckpointSink {
 public:
  // `writes`: whether this rank writes the file.
  CheckpointSink(bool writes, const std::string& path, std::string caller);
  // Writes `whole` as entry `name` on the writing rank; does nothing on the others or
  // after an error.
  void write(const std::string& name, const at::Tensor& whole);
  // Completes the file, or throws the first error as c10::Error, prefixed with
  // the caller.
  void finish();

 private:
  void keep_error(const std::exception& error);

  std::string caller_;
  std::optional<TorchSaveWriter> writer_;  // only on the writing rank, until an error
  std::string error_;                      // the first one; empty: none
};

}  // namespace hp::detail
