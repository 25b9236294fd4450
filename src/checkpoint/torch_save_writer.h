#pragma once
// A torch.save file of a dict of tensors, written one tensor at a time: each tensor's
// data goes to the file as it is written (nothing is kept), the pickled dict (names,
// dtypes, shapes) at finish(). Python's torch.load (also with weights_only=True) and
// TorchSaveReader read it.
//
// The archive is written to "<path>.partial" and renamed to `path` by finish(), so that a
// failed or abandoned save leaves no file at `path` (an older one there stays as it was).

#include <ATen/core/Tensor.h>

#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace caffe2::serialize {
class PyTorchStreamWriter;
}

namespace hp::detail {

class TorchSaveWriter {
 public:
  // Throws c10::Error naming the file when it cannot be created.
  explicit TorchSaveWriter(const std::string& path);
  // Unfinished (an error, or no finish()): removes the partial file. Never throws.
  ~TorchSaveWriter();
  TorchSaveWriter(const TorchSaveWriter&) = delete;
  TorchSaveWriter& operator=(const TorchSaveWriter&) = delete;

  // Appends `tensor` (any device; written contiguous) as entry `name`. Throws
  // c10::Error naming the file and the tensor on a write error, and
  // c10::ValueError when `name` was written before.
  void write(const std::string& name, const at::Tensor& tensor);
  // Writes the dict and the archive's directory, closes the file and moves it to `path`.
  // Throws c10::Error naming the file on any error.
  void finish();

  const std::string& path() const { return path_; }

 private:
  struct Written {
    std::string name;
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
  };

  // The message for a failed write of `what`: the system's reason when a write to the
  // file failed, `reason` otherwise.
  std::string failure(const std::string& what, const std::string& reason = "") const;
  void close_file();

  std::string path_;
  std::string partial_path_;
  std::FILE* file_ = nullptr;
  int write_errno_ = 0;  // of the first failed write to the file; later bytes are dropped
  bool abandoned_ = false;
  bool finished_ = false;
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> archive_;
  std::vector<Written> written_;
  std::set<std::string> names_;
};

}  // namespace hp::detail
