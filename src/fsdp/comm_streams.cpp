#include "comm_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#ifdef HP_WITH_NCCL
#include <ATen/cuda/Sleep.h>
#endif

namespace hp::detail {
namespace {

// The entries of HP_DEBUG_STREAMS.
bool debug_streams_has(const std::string& entry) {
  const char* value = std::getenv("HP_DEBUG_STREAMS");
  if (!value) return false;
  std::stringstream list(value);
  for (std::string item; std::getline(list, item, ',');) {
    TORCH_CHECK_VALUE(item == "serial" || item == "delay", "HP_DEBUG_STREAMS: unknown entry '",
                      item, "'; use a comma-separated list of serial, delay");
    if (item == entry) return true;
  }
  return false;
}

}  // namespace

CommStreams::CommStreams(c10::Device device) : device_(device) {
  if (!device_.is_cuda() || debug_streams_has("serial")) return;
  if (debug_streams_has("delay")) {
    const char* us = std::getenv("HP_DEBUG_STREAMS_DELAY_US");
    const int64_t micros = us ? std::stoll(us) : 2000;
    debug_delay_cycles_ = micros * 2000;  // about 2 GHz: the delay need not be exact
  }
  const c10::impl::VirtualGuardImpl impl(device_.type());
  // High priority, as FSDP2's: a collective ready to start is not held up by compute
  // kernels queued before it.
  for (auto& lane : lanes_) {
    lane.emplace(LaneState{impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true), {}});
  }
}

CommStreams::~CommStreams() {
  bool holds = false;
  for (const auto& lane : lanes_) holds = holds || (lane && !lane->held.empty());
  if (!holds) return;  // nothing the device may still read
  try {
    synchronize();
  } catch (...) {  // a failed device: its memory is gone with it
  }
}

c10::Stream CommStreams::compute_stream() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

void CommStreams::delay(c10::Stream stream) const {
  if (debug_delay_cycles_ == 0) return;
  const c10::StreamGuard on_stream(stream);
#ifdef HP_WITH_NCCL
  at::cuda::sleep(debug_delay_cycles_);
#endif
}

c10::Event CommStreams::compute_point() const {
  delay(compute_stream());
  c10::Event event(device_.type());
  event.record(compute_stream());
  return event;
}

c10::OptionalStreamGuard CommStreams::enter(Lane lane, bool after_compute) {
  if (!active()) return c10::OptionalStreamGuard();
  LaneState& state = lane_state(lane);
  free_held(state);
  if (after_compute) compute_point().block(state.stream);
  delay(state.stream);
  return c10::OptionalStreamGuard(state.stream);
}

CommHandle CommStreams::complete_on_lane(Lane lane, CommHandle handle) {
  if (!active()) return handle;
  handle.wait();  // on the lane's stream: ProcessGroupNCCL makes the lane wait, not the host
  auto done = std::make_shared<c10::Event>(device_.type());
  done->record(lane_state(lane).stream);
  const c10::Device device = device_;
  return CommHandle::deferred([done, device] {
    done->block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  });
}

void CommStreams::free_held(LaneState& state) {
  for (Held& held : state.held) {
    if (!held.compute_point.query()) held.compute_point.block(state.stream);
  }
  state.held.clear();  // freed into the lane's pool: its later work is ordered after compute's
}

void CommStreams::free_held_memory() {
  if (!active()) return;
  for (auto& lane : lanes_) free_held(*lane);
}

void CommStreams::release_after_compute(Lane lane, std::vector<at::DataPtr> memory) {
  if (!active() || memory.empty()) return;  // dropped: freed now
  lane_state(lane).held.push_back(Held{compute_point(), std::move(memory)});
}

void CommStreams::order_after_compute() {
  if (!active()) return;
  const c10::Event point = compute_point();
  for (auto& lane : lanes_) point.block(lane->stream);
}

void CommStreams::synchronize() {
  if (!device_.is_cuda()) return;
  compute_stream().synchronize();
  if (!active()) return;
  for (auto& lane : lanes_) {
    lane->stream.synchronize();
    lane->held.clear();
  }
}

}  // namespace hp::detail
