#pragma once
// A timeline of what fully_shard does on this rank: each module's forward/backward
// (and recompute) compute span, and each collective's issue, start of wait and end of wait. Off by
// default (one branch per event when off). Written as Chrome trace JSON (chrome://tracing,
// Perfetto) or drawn as an SVG picture.
//
// Times are those of the device traced. On the CPU, the host's clock when the event
// happens. On a GPU, device time: each event is a CUDA event recorded on the stream
// current when it happens (compute spans and waits on the compute stream, a collective's
// issue on its communication stream), and its time is read when the trace stops. So a
// wait is the time the compute stream stood still, and a collective is in flight from
// when its stream started it to when compute had its result, on both.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace hp::trace {

enum class Kind { kBegin, kEnd, kIssue, kWaitBegin, kWaitEnd };

struct Event {
  Kind kind;
  // "forward", "backward", "recompute" (activation recomputation reruns a forward inside
  // backward), "all_gather", "reduce_scatter", "all_reduce"
  std::string op;
  std::string module;  // the fully_shard-ed module ("root", "layers.0", ...)
  double time_us;      // since start(), on the traced device's clock
  // kIssue of a collective: the bytes this rank sends in it, counted as hp::wire_bytes()
  // counts them but for the issuing thread only (another thread's traffic at the same
  // time, an asynchronous checkpoint's, is not in it); filled in once the collective is
  // issued; 0 when not known.
  int64_t bytes = 0;
};

// Clears earlier events and starts recording, timed on `device` (World::device()).
void start(c10::Device device = c10::Device(c10::kCPU));
// Stops recording and returns the events in the order they were recorded (on a GPU,
// after waiting for the device to reach the last of them).
std::vector<Event> stop();
// Whether a trace is being recorded.
bool enabled();

// "AG issue layers.0", "forward begin root", ...: the event without its time, as
// schedule tests compare them.
std::string describe(const Event& event);

std::string to_chrome_json(const std::vector<Event>& events, int rank);
// One lane for compute and one per collective kind; a collective is drawn from its
// issue to the end of its wait (in flight), its wait as a darker part.
std::string to_svg(const std::vector<Event>& events, const std::string& title);

}  // namespace hp::trace
