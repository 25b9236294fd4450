// The trace recorder and its two renderings, on a hand-made event sequence with known
// times: what the Chrome JSON and the SVG picture say must follow from the events.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hyperparallel/trace.h"

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
  const std::string json = to_chrome_json(sample(), 3);
  EXPECT_EQ(json.rfind("{\"traceEvents\":[", 0), 0u) << json;
  EXPECT_EQ(count(json, "\"ph\":\"M\""), 4u) << "one named thread per lane";
  EXPECT_EQ(count(json, "\"ph\":\"X\""), 3u) << json;
  EXPECT_NE(json.find("{\"name\":\"a\",\"ph\":\"X\",\"pid\":3,\"tid\":0,\"ts\":0,\"dur\":100}"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("{\"name\":\"b\",\"ph\":\"X\",\"pid\":3,\"tid\":1,\"ts\":10,\"dur\":40}"),
            std::string::npos)
      << json;
  EXPECT_NE(
      json.find("{\"name\":\"wait b\",\"ph\":\"X\",\"pid\":3,\"tid\":1,\"ts\":30,\"dur\":20}"),
      std::string::npos)
      << json;
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
  const std::string svg = to_svg(events, "t<&>");
  EXPECT_NE(svg.find("<title>a&quot;&lt;&amp;&gt; 5 us</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">t&lt;&amp;&gt;</text>"), std::string::npos) << svg;
}

}  // namespace
}  // namespace hp::trace
