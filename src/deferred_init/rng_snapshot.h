#pragma once
// The state of the default random generators of some devices, to replay random draws.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <utility>
#include <vector>

namespace hp::detail {

class RngSnapshot {
 public:
  // The CPU generator and those of the accelerator devices the tensors live on.
  static RngSnapshot capture(const std::vector<at::Tensor>& tensors);
  // Adds the current state of `device`'s default generator, unless the snapshot already
  // holds that device's.
  void add(c10::Device device);
  // The same devices' generators as they are now.
  RngSnapshot current() const;
  void restore() const;

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> states_;
};

// Replays a snapshot for the scope's lifetime; the generators continue afterwards as
// if the scope had not run.
class RngReplayScope {
 public:
  explicit RngReplayScope(const RngSnapshot& snapshot);
  ~RngReplayScope();
  RngReplayScope(const RngReplayScope&) = delete;
  RngReplayScope& operator=(const RngReplayScope&) = delete;

 private:
  RngSnapshot saved_;
};

}  // namespace hp::detail
