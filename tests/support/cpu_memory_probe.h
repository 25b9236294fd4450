#pragma once
// Counts the bytes of live CPU tensor storage, and their high-water mark, by wrapping
// LibTorch's CPU allocator. Installed on first use and kept for the rest of the process:
// tensors it allocated may be freed at any later time.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace hp::testing {

class CpuMemoryProbe final : public c10::Allocator {
 public:
  static CpuMemoryProbe& installed() {
    static auto* probe = new CpuMemoryProbe();
    return *probe;
  }

  // The peak from now on is measured above what is live now.
  void reset_peak() { peak_ = live_.load(); }
  // Bytes by which the high-water mark since reset_peak() exceeded the live bytes then.
  int64_t peak_above(int64_t baseline) const { return peak_.load() - baseline; }
  int64_t live() const { return live_.load(); }

  // Live bytes once Gloo's worker threads have let go of the tensors of collectives that
  // already completed (they drop their references a moment after signalling completion).
  int64_t settled_live() const {
    int64_t previous = live();
    for (int i = 0; i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const int64_t now = live();
      if (now == previous) return now;
      previous = now;
    }
    return previous;
  }

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.emplace(data, Block{std::move(inner), static_cast<int64_t>(bytes)});
    }
    const int64_t now = live_ += static_cast<int64_t>(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    // The context is the data pointer itself, so that raw_allocate works (some ATen
    // kernels allocate scratch memory that way).
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  // Above the default CPU allocator's registration, so this one is used from now on.
  static constexpr uint8_t kPriority = 100;

  CpuMemoryProbe() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }

  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };

  static void release(void* data) {
    CpuMemoryProbe& probe = installed();
    Block block;
    {
      std::lock_guard<std::mutex> lock(probe.mutex_);
      auto found = probe.blocks_.find(data);
      block = std::move(found->second);
      probe.blocks_.erase(found);
    }
    probe.live_ -= block.bytes;
  }

  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace hp::testing
