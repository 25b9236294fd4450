#pragma once
// One file of a sharded checkpoint, in the safetensors format (an 8-byte little-endian
// header length, a JSON header naming each tensor's dtype, shape and byte range, then the
// bytes): Python's `safetensors` library and every safetensors tool read it. The header's
// "__metadata__" (string values only) carries what this library adds, e.g. checksums.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hp::detail {

// Writes `tensors` (any device; each written contiguous, in the given order) and
// `metadata` to `path`, flushed to the disk (fsync) before returning. Throws
// c10::Error naming the file and, for a failed write, the tensor.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata);

// The header of a safetensors file; tensors are read one at a time.
class SafetensorsReader {
 public:
  struct Entry {
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // byte range in the file
    uint64_t end = 0;
  };

  // Reads and checks the header. Throws c10::ValueError naming the file when it
  // cannot be opened or is not a safetensors file this library can read.
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor `name` (a host tensor of its own). Throws c10::ValueError for an
  // unknown name and c10::Error naming the file and tensor when it cannot be read.
  at::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// safetensors' name of a dtype ("F32", "BF16", ...), and back (unset: none).
std::string safetensors_dtype_name(c10::ScalarType dtype);
std::optional<c10::ScalarType> safetensors_dtype(const std::string& name);

// CRC-32 (zlib's) of a tensor's bytes as 8 hex digits; the tensor is made contiguous on
// the host first.
std::string crc32_of(const at::Tensor& tensor);
// The same of bytes.
std::string crc32_of(std::string_view bytes);

}  // namespace hp::detail
