#pragma once
// The device streams of one root's communication (FSDP2's communication context): the
// all-gathers, reduce-scatters and all-reduces of every module the root drives each run
// on a stream of their own (a lane), ordered against the compute stream by events, so
// that compute waits only for what it consumes and a prefetch is issued without waiting
// for the compute queued before it. On the CPU there are no streams: every call here does
// nothing and the collectives run exactly as they would without it.
//
// Memory. The caching allocator hands a freed block to the next allocation on the stream
// that allocated it, regardless of other streams. So:
// - a lane allocates what it makes (copy-in, casts, padding, gathered and fused outputs);
//   what the compute stream reads of it (the gathered parameters) is not freed when
//   compute is done with it but held, with an event recorded on the compute stream at that
//   point, until the lane's next enter() has made the lane wait for that event;
// - a lane that reads compute's tensors (gradients) or writes memory compute may still
//   read enters after the compute stream (enter(lane, after_compute = true)), and those
//   tensors stay referenced until compute has waited for the lane.
// No recordStream anywhere: this is also correct with TORCH_NCCL_AVOID_RECORD_STREAMS=1.
//
// Debugging (HP_DEBUG_STREAMS, a comma-separated list, read when a root makes its lanes):
// - serial: no lanes; everything runs on the compute stream (the reference a race is
//   compared against);
// - delay: each lane, when entered, and the compute stream, before each point recorded
//   on it, sleep on the device (HP_DEBUG_STREAMS_DELAY_US, 2000 by default): an ordering
//   that is missing then shows as a different result instead of a lucky one.

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <array>
#include <optional>
#include <vector>

#include "hyperparallel/comm_handle.h"

namespace hp::detail {

enum class Lane { kAllGather, kReduceScatter, kAllReduce };

class CommStreams {
 public:
  // Lanes only when `device` is a GPU (and HP_DEBUG_STREAMS has no `serial`).
  explicit CommStreams(c10::Device device);
  // Waits for the device before freeing the memory the lanes hold, if any.
  ~CommStreams();
  CommStreams(const CommStreams&) = delete;
  CommStreams& operator=(const CommStreams&) = delete;

  bool active() const { return lanes_[0].has_value(); }

  // Makes `lane`'s stream current while the returned guard lives. First the lane waits for
  // the compute points of the memory it holds, which it then frees (its allocations may
  // reuse it), and, with `after_compute`, for all work queued on the compute stream so far.
  [[nodiscard]] c10::OptionalStreamGuard enter(Lane lane, bool after_compute);
  // Within enter(lane): the collectives of `handle` finish on the lane (the lane waits for
  // them, the host does not; their completion callbacks run on the lane), and the returned
  // handle's wait() makes the compute stream wait for that point. On the CPU: `handle`.
  CommHandle complete_on_lane(Lane lane, CommHandle handle);
  // The compute stream is done with `memory` (allocated on `lane`) once the work queued on
  // it so far has run: held until the lane's next enter(). On the CPU it is freed now.
  void release_after_compute(Lane lane, std::vector<at::DataPtr> memory);
  // Frees the memory every lane holds, the lane first waiting for the compute points
  // (without it, the last modules' gathered parameters would stay allocated through the
  // optimizer step, until the next forward's all-gathers).
  void free_held_memory();
  // Every lane waits for the work queued on the compute stream so far: what compute wrote
  // outside the lanes' view (the optimizer's update of the shards) is read after it.
  void order_after_compute();
  // Blocks the host until every lane and the compute stream have run what was queued
  // (before the host reads or writes host memory the device copies: offloaded shards).
  void synchronize();

 private:
  struct Held {
    c10::Event compute_point;
    std::vector<at::DataPtr> memory;
  };
  struct LaneState {
    c10::Stream stream;
    std::vector<Held> held;
  };
  LaneState& lane_state(Lane lane) { return lanes_[static_cast<size_t>(lane)].value(); }
  void free_held(LaneState& state);
  c10::Stream compute_stream() const;
  c10::Event compute_point() const;  // an event recorded on the compute stream now

  // HP_DEBUG_STREAMS=delay: queues a sleep on `stream`.
  void delay(c10::Stream stream) const;

  c10::Device device_;
  std::array<std::optional<LaneState>, 3> lanes_;
  int64_t debug_delay_cycles_ = 0;
};

}  // namespace hp::detail
