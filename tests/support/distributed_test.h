#pragma once
// One test body, run on W ranks as separate processes:
//
//   HP_DIST_TEST(Collectives, AllReduce, 1, 2, 3, 4) {
//     auto world = hp::testing::world();
//     ...  // ordinary gtest assertions, on every rank
//   }
//
// The gtest process re-executes its own binary once per rank (through hp::launch_local,
// with a torchrun-style environment), filtered to this test. A failure on any rank fails
// the test and shows that rank's output; a run past the timeout (default 60 s, or
// HP_DIST_TEST_TIMEOUT seconds) kills every rank and fails.

#include <gtest/gtest.h>

#include <memory>

#include "hyperparallel/process_group.h"

namespace hp::testing {

// This rank's world, joined on first use (only inside a rank process).
std::shared_ptr<World> world();

// Runs `body` on `world_size` ranks (in the parent), or runs it directly when this
// process is one of those ranks. timeout_seconds 0: the default (60 s, or
// HP_DIST_TEST_TIMEOUT).
void run_distributed(const char* test_name, int world_size, void (*body)(),
                     int timeout_seconds = 0);

}  // namespace hp::testing

#define HP_DIST_TEST(suite, name, ...) HP_DIST_TEST_WITH_TIMEOUT(suite, name, 0, __VA_ARGS__)

// The same with its own timeout in seconds, for the few heavy real-network cases.
#define HP_DIST_TEST_WITH_TIMEOUT(suite, name, timeout_seconds, ...)                               \
  static void hp_dist_body_##suite##_##name();                                                     \
  TEST(suite, name) {                                                                              \
    for (int world_size : {__VA_ARGS__}) {                                                         \
      SCOPED_TRACE("world size " + std::to_string(world_size));                                    \
      ::hp::testing::run_distributed(#suite "." #name, world_size, &hp_dist_body_##suite##_##name, \
                                     timeout_seconds);                                             \
    }                                                                                              \
  }                                                                                                \
  static void hp_dist_body_##suite##_##name()
