#include "rng_snapshot.h"

#include <ATen/Context.h>

#include <algorithm>
#include <mutex>

namespace hp::detail {
namespace {

at::Tensor state_of(c10::Device device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

}  // namespace

RngSnapshot RngSnapshot::capture(const std::vector<at::Tensor>& tensors) {
  RngSnapshot snapshot;
  snapshot.add(c10::Device(c10::kCPU));
  for (const auto& t : tensors) {
    if (t.defined() && !t.is_cpu()) snapshot.add(t.device());
  }
  return snapshot;
}

void RngSnapshot::add(c10::Device device) {
  auto same = [&](const auto& entry) { return entry.first == device; };
  if (std::none_of(states_.begin(), states_.end(), same)) {
    states_.emplace_back(device, state_of(device));
  }
}

RngSnapshot RngSnapshot::current() const {
  RngSnapshot snapshot;
  for (const auto& [device, state] : states_) {
    snapshot.states_.emplace_back(device, state_of(device));
  }
  return snapshot;
}

void RngSnapshot::restore() const {
  for (const auto& [device, state] : states_) {
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
}

RngReplayScope::RngReplayScope(const RngSnapshot& snapshot) : saved_(snapshot.current()) {
  snapshot.restore();
}

RngReplayScope::~RngReplayScope() { saved_.restore(); }

}  // namespace hp::detail
