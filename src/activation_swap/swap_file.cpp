#include "swap_file.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <utility>

#include "swapped_storage.h"

namespace hp::detail {

SwapFile::SwapFile(const std::string& directory) {
  std::string name = directory + "/hp-activation-swap-XXXXXX";
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) {
    C10_THROW_ERROR(Error, "activation swap: cannot make a swap file in '" + directory +
                               "': " + std::strerror(errno) +
                               ". Give ActivationSwapOptions::directory (or TMPDIR) a writable "
                               "directory on a local disk");
  }
  path_ = name;
  if (::unlink(name.c_str()) != 0) {
    const int error = errno;
    ::close(fd_);
    C10_THROW_ERROR(Error, "activation swap: cannot unlink the swap file " + path_ + ": " +
                               std::strerror(error) +
                               ". Give ActivationSwapOptions::directory a directory where this "
                               "process may remove the files it makes");
  }
  reader_ = std::thread(&SwapFile::read_loop, this);
}

SwapFile::~SwapFile() {
  {
    std::lock_guard<std::mutex> lock(reads_mutex_);
    stopping_ = true;
  }
  reads_ready_.notify_one();
  reader_.join();
  ::close(fd_);
}

int64_t SwapFile::write(const void* data, int64_t bytes) {
  int64_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(space_mutex_);
    offset = end_;
    end_ += bytes;
    live_ += bytes;
  }
  const char* from = static_cast<const char*>(data);
  for (int64_t done = 0; done < bytes;) {
    const ssize_t wrote = ::pwrite(fd_, from + done, bytes - done, offset + done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      const int error = wrote < 0 ? errno : ENOSPC;
      release(bytes);
      C10_THROW_ERROR(Error, "activation swap: writing " + std::to_string(bytes) + " bytes to " +
                                 path_ + " (unlinked) failed: " + std::strerror(error) +
                                 ". Free space on that file system, or put the swap file on "
                                 "another one with ActivationSwapOptions::directory");
    }
    done += wrote;
  }
  return offset;
}

c10::Storage SwapFile::read(int64_t offset, int64_t bytes) const {
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, c10::GetCPUAllocator());
  char* to = static_cast<char*>(storage.mutable_data());
  for (int64_t done = 0; done < bytes;) {
    const ssize_t got = ::pread(fd_, to + done, bytes - done, offset + done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      C10_THROW_ERROR(Error, "activation swap: reading " + std::to_string(bytes) + " bytes from " +
                                 path_ + " (unlinked) failed: " +
                                 (got < 0 ? std::strerror(errno) : "the file ends early") +
                                 ". The disk failed, or something changed the file under the "
                                 "process");
    }
    done += got;
  }
  return storage;
}

std::shared_future<c10::Storage> SwapFile::read_async(int64_t offset, int64_t bytes) {
  auto promise = std::make_shared<std::promise<c10::Storage>>();
  std::shared_future<c10::Storage> result = promise->get_future().share();
  {
    std::lock_guard<std::mutex> lock(reads_mutex_);
    reads_.emplace_back([this, promise, offset, bytes] {
      try {
        promise->set_value(read(offset, bytes));
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  }
  reads_ready_.notify_one();
  return result;
}

void SwapFile::release(int64_t bytes) {
  std::lock_guard<std::mutex> lock(space_mutex_);
  live_ -= bytes;
  if (live_ > 0) return;
  // Nothing in the file is needed any more: its space goes back to the file system.
  end_ = 0;
  if (::ftruncate(fd_, 0) != 0) {
    // Only the space stays in use; the next writes overwrite it from the start.
  }
}

void SwapFile::read_loop() {
  std::unique_lock<std::mutex> lock(reads_mutex_);
  while (true) {
    reads_ready_.wait(lock, [this] { return stopping_ || !reads_.empty(); });
    if (stopping_) return;
    std::function<void()> next = std::move(reads_.front());
    reads_.pop_front();
    lock.unlock();
    next();
    lock.lock();
  }
}

namespace {

class FileSwappedStorage final : public SwappedStorage {
 public:
  FileSwappedStorage(const c10::Storage& storage, std::shared_ptr<SwapFile> file)
      : file_(std::move(file)),
        bytes_(static_cast<int64_t>(storage.nbytes())),
        offset_(file_->write(storage.data(), bytes_)) {}
  ~FileSwappedStorage() override { file_->release(bytes_); }

  bool load() override {
    if (back_.valid()) return false;
    back_ = file_->read_async(offset_, bytes_);
    return true;
  }
  bool loaded() override {
    return back_.valid() && back_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  c10::Storage wait() override {
    load();
    return back_.get();
  }
  void drop() override { back_ = {}; }

 private:
  std::shared_ptr<SwapFile> file_;
  int64_t bytes_;
  int64_t offset_;
  std::shared_future<c10::Storage> back_;
};

}  // namespace

std::unique_ptr<SwappedStorage> swap_to_file(const c10::Storage& storage,
                                             std::shared_ptr<SwapFile> file) {
  return std::make_unique<FileSwappedStorage>(storage, std::move(file));
}

}  // namespace hp::detail
