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
// process is one of those ranks.
void run_distributed(const char* test_name, int world_size, void (*body)());

}  // namespace hp::testing

#define HP_DIST_TEST(suite, name, ...)                                \
  static void hp_dist_body_##suite##_##name();                        \
  TEST(suite, name) {                                                 \
    for (int world_size : {__VA_ARGS__}) {                            \
      SCOPED_TRACE("world size " + std::to_string(world_size));       \
      ::hp::testing::run_distributed(#suite "." #name, world_size,    \
                                     &hp_dist_body_##suite##_##name); \
    }                                                                 \
  }                                                                   \
  static void hp_dist_body_##suite##_##name()
