#pragma once
// The file behind the activation swap of CPU tensors, as DeepSpeed's NVMe offload keeps
// activations on a local disk. Made in a chosen directory and unlinked at once, so its
// space goes back to the file system when the process ends, however it ends. Written by
// the forward thread, read back by a thread of its own (reads queue in the order they are
// asked for). Emptied whenever nothing in it is needed any more (after each backward).

#include <c10/core/Storage.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

namespace hp::detail {

class SwapFile {
 public:
  // Throws c10::Error naming the directory and the fix when no file can be made there.
  explicit SwapFile(const std::string& directory);
  // Pending reads are dropped (nobody waits for them: their storages hold the file).
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  // Appends `bytes` bytes; returns their offset. Throws c10::Error naming the file and the
  // fix when the write fails (a full disk, a file size limit).
  int64_t write(const void* data, int64_t bytes);
  // Reads `bytes` bytes at `offset` into a fresh CPU storage, on the reader thread.
  std::shared_future<c10::Storage> read_async(int64_t offset, int64_t bytes);
  // Bytes written earlier that nobody will read again.
  void release(int64_t bytes);

  const std::string& path() const { return path_; }

 private:
  void read_loop();
  c10::Storage read(int64_t offset, int64_t bytes) const;

  std::string path_;
  int fd_ = -1;

  std::mutex space_mutex_;
  int64_t end_ = 0;   // where the next write goes
  int64_t live_ = 0;  // bytes written and not released

  std::mutex reads_mutex_;
  std::condition_variable reads_ready_;
  std::deque<std::function<void()>> reads_;
  bool stopping_ = false;
  std::thread reader_;
};

}  // namespace hp::detail
