#pragma once
// A timeline of what fully_shard does on this rank: each module's forward/backward
// (and recompute) compute span, and each collective's issue, start of wait and end of wait. Off by
// default (one branch per event when off). Written as Chrome trace JSON (chrome://tracing,
// Perfetto) or drawn as an SVG picture.

#include <string>
#include <string_view>
#include <vector>

namespace hp::trace {

enum class Kind { kBegin, kEnd, kIssue, kWaitBegin, kWaitEnd };

struct Event {
  Kind kind;
  // "forward", "backward", "recompute" (activation recomputation reruns a forward inside
  // backward), "all_gather", "reduce_scatter", "all_reduce"
  std::string op;
  std::string module;  // the fully_shard-ed module ("root", "layers.0", ...)
  double time_us;      // since start()
};

void start();               // clears earlier events and starts recording
std::vector<Event> stop();  // stops recording and returns the events in order
bool enabled();
void record(Kind kind, std::string_view op, std::string_view module);

// "AG issue layers.0", "forward begin root", ...: the event without its time, as
// schedule tests compare them.
std::string describe(const Event& event);

std::string to_chrome_json(const std::vector<Event>& events, int rank);
// One lane for compute and one per collective kind; a collective is drawn from its
// issue to the end of its wait (in flight), its wait as a darker part.
std::string to_svg(const std::vector<Event>& events, const std::string& title);

}  // namespace hp::trace
