#include "safetensors_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>

#include "file_size_limit.h"

namespace hp::detail {
namespace {

using nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian numbers; this host writes them as they are");

// safetensors' dtype names.
const std::vector<std::pair<c10::ScalarType, std::string>>& dtype_names() {
  static const std::vector<std::pair<c10::ScalarType, std::string>> names = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},    {at::kBool, "BOOL"}};
  return names;
}

// Writes all of `size` bytes at the file's position; false (errno set) on an error.
bool write_all(int fd, const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) {
      if (written == 0) errno = EIO;
      return false;
    }
    bytes += written;
    size -= static_cast<size_t>(written);
  }
  return true;
}

// Reads all of `size` bytes at `offset`; false on an error or a short file.
bool read_all(int fd, void* data, size_t size, uint64_t offset) {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::pread(fd, bytes, size, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      if (got == 0) errno = 0;  // end of file: truncated
      return false;
    }
    bytes += got;
    size -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

std::string reason(int error) {
  return error != 0 ? write_error_text(error) : "the file ends early";
}

}  // namespace

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == dtype) return name;
  }
  C10_THROW_ERROR(ValueError,
                  std::string("dtype ") + c10::toString(dtype) + " has no safetensors name");
}

std::optional<c10::ScalarType> safetensors_dtype(const std::string& name) {
  for (const auto& [type, type_name] : dtype_names()) {
    if (type_name == name) return type;
  }
  return std::nullopt;
}

std::string crc32_of(const at::Tensor& tensor) {
  const at::Tensor bytes = tensor.to(at::kCPU).contiguous();
  return crc32_of(std::string_view(static_cast<const char*>(bytes.data_ptr()),
                                   static_cast<size_t>(bytes.numel()) * bytes.element_size()));
}

std::string crc32_of(std::string_view bytes) {
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08lx", crc32_z(crc32_z(0, nullptr, 0), data, bytes.size()));
  return hex;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    header[name] = {{"dtype", safetensors_dtype_name(tensor.scalar_type())},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t header_size = text.size();

  let_oversized_writes_fail();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) C10_THROW_ERROR(Error, "cannot create " + path + ": " + std::strerror(errno));
  auto fail = [&](const std::string& what) {
    const int error = errno;
    ::close(fd);
    C10_THROW_ERROR(Error, "cannot write " + what + " to " + path + ": " + reason(error));
  };
  if (!write_all(fd, &header_size, sizeof header_size) ||
      !write_all(fd, text.data(), text.size())) {
    fail("the header");
  }
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor host = tensor.to(at::kCPU).contiguous();
    if (!write_all(fd, host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size())) {
      fail("tensor '" + name + "'");
    }
  }
  if (::fsync(fd) != 0) fail("its data (fsync)");
  if (::close(fd) != 0) {
    C10_THROW_ERROR(Error, "cannot write " + path + " (close): " + std::strerror(errno));
  }
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) C10_THROW_ERROR(ValueError, "cannot open " + path_ + ": " + std::strerror(errno));
  auto bad = [&](const std::string& why) {
    ::close(fd_);
    fd_ = -1;
    C10_THROW_ERROR(ValueError, path_ + " is not a safetensors file this library reads: " + why);
  };
  uint64_t header_size = 0;
  if (!read_all(fd_, &header_size, sizeof header_size, 0)) bad("it ends before its header");
  struct stat info{};
  if (::fstat(fd_, &info) != 0 || header_size > static_cast<uint64_t>(info.st_size) - 8) {
    bad("its header length exceeds the file");
  }
  std::string text(header_size, '\0');
  if (!read_all(fd_, text.data(), text.size(), 8)) bad("it ends inside its header");
  json header;
  try {
    header = json::parse(text);
    const uint64_t data_start = 8 + header_size;
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        metadata_ = value.get<std::map<std::string, std::string>>();
        continue;
      }
      const std::optional<c10::ScalarType> dtype =
          safetensors_dtype(value.at("dtype").get<std::string>());
      if (!dtype) bad("tensor '" + name + "' has dtype " + value.at("dtype").dump());
      Entry entry{*dtype, value.at("shape").get<std::vector<int64_t>>(),
                  data_start + value.at("data_offsets").at(0).get<uint64_t>(),
                  data_start + value.at("data_offsets").at(1).get<uint64_t>()};
      int64_t numel = 1;
      for (int64_t extent : entry.shape) numel *= extent;
      if (entry.end < entry.begin ||
          entry.end - entry.begin != static_cast<uint64_t>(numel) * c10::elementSize(*dtype) ||
          entry.end > static_cast<uint64_t>(info.st_size)) {
        bad("tensor '" + name + "' has a byte range that does not fit its shape or the file");
      }
      entries_.emplace(name, std::move(entry));
    }
  } catch (const json::exception& error) {
    bad(std::string("its header is not what safetensors writes (") + error.what() + ")");
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    C10_THROW_ERROR(ValueError, "no tensor '" + name + "' in " + path_);
  }
  const Entry& entry = it->second;
  at::Tensor tensor = at::empty(entry.shape, at::dtype(entry.dtype));
  errno = 0;
  if (!read_all(fd_, tensor.data_ptr(), entry.end - entry.begin, entry.begin)) {
    C10_THROW_ERROR(Error,
                    "cannot read tensor '" + name + "' from " + path_ + ": " + reason(errno));
  }
  return tensor;
}

}  // namespace hp::detail
