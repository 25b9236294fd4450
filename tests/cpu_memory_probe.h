#pragma once
// Counts the bytes of live CPU tensor storage, and their high-water mark, by wrapping
// LibTorch's CPU allocator. Installed on first use and kept for the rest of the process:
// tensors it allocated may be freed at any later time.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>

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

  c10::DataPtr allocate(size_t bytes) override {
    auto* record = new Allocation{base_->allocate(bytes), static_cast<int64_t>(bytes), this};
    const int64_t now = live_ += record->bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {record->inner.get(), record, &release, record->inner.device()};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  // Above the default CPU allocator's registration, so this one is used from now on.
  static constexpr uint8_t kPriority = 100;

  CpuMemoryProbe() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }

  struct Allocation {
    c10::DataPtr inner;
    int64_t bytes;
    CpuMemoryProbe* owner;
  };

  static void release(void* context) {
    auto* record = static_cast<Allocation*>(context);
    record->owner->live_ -= record->bytes;
    delete record;
  }

  c10::Allocator* base_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace hp::testing
