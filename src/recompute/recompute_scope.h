#pragma once
// Marks a forward that activation recomputation reruns only to recover saved tensors
// (the non-reentrant kind): the graph it builds is thrown away, so fully_shard must not
// hang backward hooks on it.

namespace hp::detail {

class SavedTensorRecomputeScope {
 public:
  SavedTensorRecomputeScope() { ++depth(); }
  ~SavedTensorRecomputeScope() { --depth(); }
  SavedTensorRecomputeScope(const SavedTensorRecomputeScope&) = delete;
  SavedTensorRecomputeScope& operator=(const SavedTensorRecomputeScope&) = delete;

  static bool active() { return depth() > 0; }

 private:
  static int& depth() {
    thread_local int value = 0;
    return value;
  }
};

}  // namespace hp::detail
