#include "hyperparallel/trace.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "trace_recording.h"

namespace hp::trace {
namespace {

using Clock = std::chrono::steady_clock;

struct Recorder {
  std::atomic<bool> on{false};
  std::mutex mutex;
  c10::Device device{c10::kCPU};
  Clock::time_point origin;
  // On a GPU: the device events of start() and of each recorded event (same order).
  std::optional<c10::Event> device_origin;
  std::vector<c10::Event> device_marks;
  std::vector<Event> events;
};

// An event recorded now on `device`'s current stream, timed.
c10::Event device_mark(c10::Device device) {
  c10::Event mark(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  mark.record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  return mark;
}

Recorder& recorder() {
  static Recorder r;
  return r;
}

const char* short_name(const std::string& op) {
  if (op == "all_gather") return "AG";
  if (op == "reduce_scatter") return "RS";
  if (op == "all_reduce") return "AR";
  return nullptr;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kBegin:
      return "begin";
    case Kind::kEnd:
      return "end";
    case Kind::kIssue:
      return "issue";
    case Kind::kWaitBegin:
      return "wait";
    case Kind::kWaitEnd:
      return "done";
  }
  return "?";
}

// Lanes of the picture: compute, then one per collective.
int lane_of(const std::string& op) {
  if (op == "all_gather") return 1;
  if (op == "reduce_scatter") return 2;
  if (op == "all_reduce") return 3;
  return 0;
}

struct Span {
  int lane;
  double begin, end, wait_begin;  // wait_begin < 0: no wait part
  std::string op, label, color;
  int64_t bytes = 0;  // a collective's, when recorded
};

// Pairs begin/end and issue/wait/done per (op, module), in order.
std::vector<Span> spans_of(const std::vector<Event>& events) {
  struct Open {
    double begin, wait;
    int64_t bytes;
  };
  std::map<std::string, std::deque<Open>> open;
  std::vector<Span> spans;
  for (const Event& e : events) {
    const std::string key = e.op + "|" + e.module;
    auto& queue = open[key];
    switch (e.kind) {
      case Kind::kBegin:
      case Kind::kIssue:
        queue.push_back({e.time_us, -1.0, e.bytes});
        break;
      case Kind::kWaitBegin:
        if (!queue.empty()) queue.front().wait = e.time_us;
        break;
      case Kind::kEnd:
      case Kind::kWaitEnd: {
        if (queue.empty()) break;
        const Open started = queue.front();
        queue.pop_front();
        const bool compute = lane_of(e.op) == 0;
        const char* color = e.op == "forward"          ? "#4e79a7"
                            : e.op == "recompute"      ? "#17becf"
                            : compute                  ? "#59a14f"
                            : e.op == "all_gather"     ? "#f28e2b"
                            : e.op == "reduce_scatter" ? "#e15759"
                                                       : "#b07aa1";
        spans.push_back({lane_of(e.op), started.begin, e.time_us, started.wait, e.op, e.module,
                         color, started.bytes});
        break;
      }
    }
  }
  return spans;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

void start(c10::Device device) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.clear();
  r.device_marks.clear();
  r.device = device;
  r.device_origin.reset();
  if (!device.is_cpu()) r.device_origin.emplace(device_mark(device));
  r.origin = Clock::now();
  r.on = true;
}

std::vector<Event> stop() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.on = false;
  if (r.device_origin) {
    // Both ends of an interval must have completed; a lane's event may complete before
    // the origin on the compute stream.
    r.device_origin->synchronize();
    for (size_t i = 0; i < r.events.size(); ++i) {
      r.device_marks[i].synchronize();
      r.events[i].time_us = r.device_origin->elapsedTime(r.device_marks[i]) * 1000.0;
    }
    r.device_marks.clear();
    r.device_origin.reset();
  }
  return std::move(r.events);
}

bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

void record(Kind kind, std::string_view op, std::string_view module) {
  Recorder& r = recorder();
  if (!r.on.load(std::memory_order_relaxed)) return;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(r.mutex);
  // On a GPU the time is filled in by stop(), from the device event.
  if (r.device_origin) r.device_marks.push_back(device_mark(r.device));
  r.events.push_back({kind, std::string(op), std::string(module),
                      std::chrono::duration<double, std::micro>(now - r.origin).count()});
}

void record_bytes(std::string_view op, std::string_view module, int64_t bytes) {
  Recorder& r = recorder();
  if (!r.on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.events.rbegin(); it != r.events.rend(); ++it) {
    if (it->kind == Kind::kIssue && it->op == op && it->module == module) {
      it->bytes = bytes;
      return;
    }
  }
}

std::string describe(const Event& event) {
  const char* name = short_name(event.op);
  return std::string(name ? name : event.op.c_str()) + " " + kind_name(event.kind) + " " +
         event.module;
}

std::string to_chrome_json(const std::vector<Event>& events, int rank) {
  static const char* lanes[] = {"compute", "all-gather", "reduce-scatter", "all-reduce"};
  nlohmann::json trace_events = nlohmann::json::array();
  for (int lane = 0; lane < 4; ++lane) {
    trace_events.push_back({{"name", "thread_name"},
                            {"ph", "M"},
                            {"pid", rank},
                            {"tid", lane},
                            {"args", {{"name", lanes[lane]}}}});
  }
  const auto span = [&](const std::string& name, int lane, double begin, double end,
                        int64_t bytes) {
    nlohmann::json event = {{"name", name}, {"ph", "X"},   {"pid", rank},
                            {"tid", lane},  {"ts", begin}, {"dur", end - begin}};
    if (bytes > 0) event["args"] = {{"bytes_sent", bytes}};
    trace_events.push_back(std::move(event));
  };
  for (const Span& s : spans_of(events)) {
    span(s.label, s.lane, s.begin, s.end, s.bytes);
    if (s.wait_begin >= 0) span("wait " + s.label, s.lane, s.wait_begin, s.end, 0);
  }
  // Module names come from the user's model; dump() escapes them (and replaces bytes that
  // are not UTF-8 instead of failing).
  return nlohmann::json{{"traceEvents", trace_events}}.dump(
             -1, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}

std::string to_svg(const std::vector<Event>& events, const std::string& title) {
  static const char* lanes[] = {"compute", "all-gather", "reduce-scatter", "all-reduce"};
  const std::vector<Span> spans = spans_of(events);
  double end = 1;
  for (const Span& s : spans) end = std::max(end, s.end);
  const double left = 110, width = 1100, lane_height = 34, top = 40;
  auto x = [&](double t) { return left + t / end * width; };
  std::ostringstream out;
  char buffer[256];
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 20 << "\" height=\""
      << top + 4 * lane_height + 40 << "\" font-family=\"sans-serif\" "
      << "font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"10\" y=\"20\" font-size=\"14\">" << xml_escape(title) << "</text>\n";
  for (int lane = 0; lane < 4; ++lane) {
    const double y = top + lane * lane_height;
    out << "<text x=\"10\" y=\"" << y + 20 << "\">" << lanes[lane] << "</text>\n"
        << "<line x1=\"" << left << "\" x2=\"" << left + width << "\" y1=\"" << y + lane_height
        << "\" y2=\"" << y + lane_height << "\" stroke=\"#ddd\"/>\n";
  }
  for (const Span& s : spans) {
    // The root's compute span encloses the blocks' spans: draw it as a thin bar above.
    // A recompute (activation recomputation) runs inside a backward span: a thin bar
    // below. A white outline keeps back-to-back spans (blocks of a forward) apart.
    const bool enclosing = s.lane == 0 && s.label == "root";
    const bool recompute = s.op == "recompute";
    const bool bar = enclosing || recompute;
    const double y = top + s.lane * lane_height + (enclosing ? 0 : recompute ? lane_height - 4 : 4);
    const double height = bar ? 3 : lane_height - 8;
    const std::string sent = s.bytes > 0 ? ", " + std::to_string(s.bytes) + " bytes sent" : "";
    std::snprintf(buffer, sizeof(buffer),
                  "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\" "
                  "fill-opacity=\"0.55\" stroke=\"white\"><title>%s %.0f us%s</title></rect>\n",
                  x(s.begin), y, std::max(0.5, x(s.end) - x(s.begin)), height, s.color.c_str(),
                  xml_escape(s.label).c_str(), s.end - s.begin, sent.c_str());
    out << buffer;
    if (!bar && x(s.end) - x(s.begin) > 7.0 * s.label.size()) {
      std::snprintf(buffer, sizeof(buffer), "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                    x(s.begin) + 3, y + height / 2 + 4, xml_escape(s.label).c_str());
      out << buffer;
    }
    if (s.wait_begin >= 0) {
      std::snprintf(buffer, sizeof(buffer),
                    "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"black\" "
                    "fill-opacity=\"0.45\"/>\n",
                    x(s.wait_begin), y + (lane_height - 8) / 2,
                    std::max(0.5, x(s.end) - x(s.wait_begin)), (lane_height - 8) / 2);
      out << buffer;
    }
  }
  std::snprintf(buffer, sizeof(buffer),
                "<text x=\"%.0f\" y=\"%.0f\">0</text><text x=\"%.0f\" y=\"%.0f\" "
                "text-anchor=\"end\">%.1f ms</text>\n",
                left, top + 4 * lane_height + 16, left + width, top + 4 * lane_height + 16,
                end / 1000);
  out << buffer << "<text x=\"" << left + width / 2 << "\" y=\"" << top + 4 * lane_height + 32
      << "\" text-anchor=\"middle\">pale: collective in flight (issue to done); dark: the "
         "caller waiting for it; blue: forward, green: backward, cyan: recompute</text>\n</svg>\n";
  return out.str();
}

}  // namespace hp::trace
