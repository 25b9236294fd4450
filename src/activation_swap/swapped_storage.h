#pragma once
// One storage that autograd saved, moved off its device by activation swap: its bytes in
// a swap file (a CPU storage) or in pinned host memory (a GPU storage), and, while
// backward needs them, their copy back on the device. Callers serialize the calls.

#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <memory>

namespace hp::detail {

class SwapFile;

class SwappedStorage {
 public:
  virtual ~SwappedStorage() = default;
  // Starts bringing the bytes back; false when that is under way or done already.
  virtual bool load() = 0;
  // Back: wait() will not block.
  virtual bool loaded() = 0;
  // The bytes back on their device in a fresh storage (loading them first if needed). On
  // a GPU the current stream waits for the copy, not the host.
  virtual c10::Storage wait() = 0;
  // Forgets the copy on the device; the swapped bytes stay for another load.
  virtual void drop() = 0;
};

// Writes the bytes of a CPU storage to `file` now.
std::unique_ptr<SwappedStorage> swap_to_file(const c10::Storage& storage,
                                             std::shared_ptr<SwapFile> file);

// Copies a GPU storage to pinned host memory on `side` (a stream of its device), after
// the work queued so far on the current stream.
std::unique_ptr<SwappedStorage> swap_to_host(const c10::Storage& storage, c10::Stream side);

}  // namespace hp::detail
