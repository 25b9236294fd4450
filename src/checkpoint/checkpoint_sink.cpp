#include "checkpoint_sink.h"

#include <c10/util/Exception.h>

#include "../distributed/error_message.h"

namespace hp::detail {

CheckpointSink::CheckpointSink(bool writes, const std::string& path, std::string caller)
    : caller_(std::move(caller)) {
  if (!writes) return;
  try {
    writer_.emplace(path);
  } catch (const std::exception& error) {
    keep_error(error);
  }
}

void CheckpointSink::keep_error(const std::exception& error) {
  error_ = message_of(error);
  writer_.reset();  // removes the partial file
}

void CheckpointSink::write(const std::string& name, const at::Tensor& whole) {
  if (!writer_) return;
  try {
    writer_->write(name, whole);
  } catch (const std::exception& error) {
    keep_error(error);
  }
}

void CheckpointSink::finish() {
  if (writer_) {
    try {
      writer_->finish();
    } catch (const std::exception& error) {
      keep_error(error);
    }
  }
  if (!error_.empty()) C10_THROW_ERROR(Error, caller_ + ": " + error_);
}

}  // namespace hp::detail
