#pragma once
// A torch.save file of a dict of tensors, read one tensor at a time: opening it reads the
// pickled dict (names, dtypes, shapes: no tensor data), read() then loads one tensor's
// record. Files written by Python's torch.save and by TorchSaveWriter both read.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace hp::detail {

class TorchSaveReader {
 public:
  // One tensor of the dict: a strided view of a storage kept in the archive's `record`.
  struct Entry {
    std::string name;
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;
    int64_t storage_offset = 0;
    int64_t storage_bytes = 0;
    std::string record;  // "data/<key>"; empty for an empty storage (no record)
  };

  // Throws c10::ValueError naming `path` when it cannot be opened or is no
  // torch.save archive of a dict from names to dense tensors.
  explicit TorchSaveReader(const std::string& path);
  ~TorchSaveReader();
  TorchSaveReader(const TorchSaveReader&) = delete;
  TorchSaveReader& operator=(const TorchSaveReader&) = delete;

  const std::string& path() const { return path_; }
  // In the order of the file's dict.
  const std::vector<Entry>& entries() const { return entries_; }
  // nullptr when the file has no tensor of that name.
  const Entry* find(const std::string& name) const;
  // The tensor, on the host, holding only its own storage. Throws c10::Error
  // naming the file and the tensor when its record cannot be read or its bytes fail the
  // CRC-32 the archive stores for them.
  at::Tensor read(const Entry& entry);

 private:
  std::string path_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::unordered_map<std::string, uint32_t> record_crcs_;  // "data/<key>" -> stored CRC-32
};

}  // namespace hp::detail
