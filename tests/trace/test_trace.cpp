// The trace recorder and its two renderings, on a hand-made event sequence with known
// times: what the Chrome JSON and the SVG picture say must follow from the events.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/trace/trace_recording.h"

namespace hp::trace {
namespace {

// Module "a" computes for 100 us; during it module "b"'s all-gather is issued at 10 us,
// waited for from 30 us and done at 50 us.
std::vector<Event> sample() {
  return {{Kind::kBegin, "forward", "a", 0},
          {Kind::kIssue, "all_gather", "b", 10},
          {Kind::kWaitBegin, "all_gather", "b", 30},
          {Kind::kWaitEnd, "all_gather", "b", 50},
          {Kind::kEnd, "forward", "a", 100}};
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(Trace, RecordsOnlyBetweenStartAndStop) {
  record(Kind::kBegin, "forward", "before");
  start();
  EXPECT_TRUE(enabled());
  record(Kind::kIssue, "reduce_scatter", "m");
  record(Kind::kWaitBegin, "reduce_scatter", "m");
  const std::vector<Event> events = stop();
  EXPECT_FALSE(enabled());
  record(Kind::kEnd, "forward", "after");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(describe(events[0]), "RS issue m");
  EXPECT_EQ(describe(events[1]), "RS wait m");
  EXPECT_LE(events[0].time_us, events[1].time_us);
  start();  // starting again clears what an earlier recording left
  EXPECT_TRUE(stop().empty());
}

TEST(Trace, ChromeJsonHasOneSpanPerPairAndTheWait) {
  const nlohmann::json trace = nlohmann::json::parse(to_chrome_json(sample(), 3));
  std::vector<nlohmann::json> threads, spans;
  for (const auto& event : trace.at("traceEvents")) {
    EXPECT_EQ(event.at("pid"), 3) << event;
    (event.at("ph") == "M" ? threads : spans).push_back(event);
  }
  EXPECT_EQ(threads.size(), 4u) << "one named thread per lane";
  const auto span = [](const char* name, int lane, double begin, double duration) {
    return nlohmann::json{{"name", name}, {"ph", "X"},   {"pid", 3},
                          {"tid", lane},  {"ts", begin}, {"dur", duration}};
  };
  // In the order they end.
  EXPECT_EQ(spans, (std::vector<nlohmann::json>{span("b", 1, 10, 40), span("wait b", 1, 30, 20),
                                                span("a", 0, 0, 100)}))
      << trace;
}

TEST(Trace, ACollectiveCarriesTheBytesItSent) {
  start();
  record(Kind::kIssue, "all_gather", "m");
  record(Kind::kIssue, "all_gather", "m");  // the latest one gets the bytes
  record_bytes("all_gather", "m", 4096);
  record(Kind::kWaitBegin, "all_gather", "m");
  record(Kind::kWaitEnd, "all_gather", "m");
  record(Kind::kWaitBegin, "all_gather", "m");
  record(Kind::kWaitEnd, "all_gather", "m");
  const std::vector<Event> events = stop();
  ASSERT_EQ(events.size(), 6u);
  EXPECT_EQ(events[0].bytes, 0);
  EXPECT_EQ(events[1].bytes, 4096);
  const nlohmann::json trace = nlohmann::json::parse(to_chrome_json(events, 0));
  int with_bytes = 0;
  for (const auto& event : trace.at("traceEvents")) {
    if (event.contains("args") && event.at("args").contains("bytes_sent")) {
      EXPECT_EQ(event.at("args").at("bytes_sent"), 4096) << event;
      ++with_bytes;
    }
  }
  EXPECT_EQ(with_bytes, 1);
  EXPECT_EQ(count(to_svg(events, "t"), ", 4096 bytes sent</title>"), 1u);
}

TEST(Trace, SvgDrawsEverySpanAndWait) {
  const std::string svg = to_svg(sample(), "title");
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("<title>a 100 us</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>b 40 us</title>"), std::string::npos) << svg;
  EXPECT_EQ(count(svg, "fill=\"black\""), 1u) << "one wait";
  for (const char* lane : {"compute", "all-gather", "reduce-scatter", "all-reduce"}) {
    EXPECT_NE(svg.find(std::string(">") + lane + "</text>"), std::string::npos) << lane;
  }
}

TEST(Trace, NamesAreQuotedForEachFormat) {
  const std::vector<Event> events = {{Kind::kBegin, "forward", "a\"<&>", 0},
                                     {Kind::kEnd, "forward", "a\"<&>", 5}};
  EXPECT_NE(to_chrome_json(events, 0).find("\"name\":\"a\\\"<&>\""), std::string::npos);
  // Bytes that are not UTF-8 do not make the trace unwritable.
  const std::vector<Event> binary = {{Kind::kBegin, "forward", "m\xff", 0},
                                     {Kind::kEnd, "forward", "m\xff", 5}};
  EXPECT_EQ(nlohmann::json::parse(to_chrome_json(binary, 0))["traceEvents"][4]["name"],
            "m\xef\xbf\xbd");
  const std::string svg = to_svg(events, "t<&>");
  EXPECT_NE(svg.find("<title>a&quot;&lt;&amp;&gt; 5 us</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">t&lt;&amp;&gt;</text>"), std::string::npos) << svg;
}

}  // namespace
}  // namespace hp::trace
