#include "durable_files.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "file_size_limit.h"

namespace hp::detail {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  C10_THROW_ERROR(Error, "cannot " + what + " " + path + ": " + write_error_text(error));
}

std::string parent_of(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace

void write_file_durably(const std::string& path, const std::string& text) {
  let_oversized_writes_fail();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", path, errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t written = ::write(fd, text.data() + done, text.size() - done);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) {
      const int error = written < 0 ? errno : EIO;
      ::close(fd);
      fail("write", path, error);
    }
    done += static_cast<size_t>(written);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    fail("flush", path, error);
  }
  if (::close(fd) != 0) fail("close", path, errno);
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", dir, errno);
  const int result = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (result != 0) fail("flush directory", dir, error);
}

void replace_directory(const std::string& staged, const std::string& target) {
  namespace fs = std::filesystem;
  const std::string aside = target + ".old";
  std::error_code ec;
  fs::remove_all(aside, ec);  // left by an earlier replacement that crashed
  if (ec) fail("remove", aside, ec.value());
  const bool replacing = fs::exists(target);
  if (replacing && std::rename(target.c_str(), aside.c_str()) != 0)
    fail("move aside", target, errno);
  if (std::rename(staged.c_str(), target.c_str()) != 0)
    fail("rename " + staged + " to", target, errno);
  sync_directory(parent_of(target));
  if (replacing) {
    fs::remove_all(aside, ec);
    if (ec) fail("remove", aside, ec.value());
  }
}

}  // namespace hp::detail
