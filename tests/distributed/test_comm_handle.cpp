#include <gtest/gtest.h>

#include <stdexcept>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm_handle_internals.h"
#include "hyperparallel/comm_handle.h"

namespace hp {
namespace {

TEST(CommHandle, DefaultHandleIsCompleted) {
  CommHandle handle;
  EXPECT_FALSE(handle.pending());
  EXPECT_FALSE(testing::has_work(handle));
  handle.wait();
  handle.wait();
  EXPECT_FALSE(handle.pending());
}

TEST(CommHandle, DeferredCallbackRunsOnceAtFirstWait) {
  int runs = 0;
  CommHandle handle = CommHandle::deferred([&] { ++runs; });
  EXPECT_TRUE(handle.pending());
  EXPECT_FALSE(testing::has_work(handle));
  EXPECT_EQ(runs, 0) << "a deferred handle must not run its callback before wait()";
  handle.wait();
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(handle.pending());
  handle.wait();
  EXPECT_EQ(runs, 1) << "a second wait() must do nothing";
}

TEST(CommHandle, CopiesShareCompletion) {
  int runs = 0;
  CommHandle first = CommHandle::deferred([&] { ++runs; });
  CommHandle second = first;
  second.wait();
  first.wait();
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(first.pending());
}

TEST(CommHandle, ReentrantWaitDoesNotRunTwice) {
  int runs = 0;
  CommHandle handle;
  handle = CommHandle::deferred([&] {
    ++runs;
    handle.wait();
  });
  handle.wait();
  EXPECT_EQ(runs, 1);
}

TEST(CommHandle, ThrowingCallbackSurfacesOnceAndCompletes) {
  int runs = 0;
  CommHandle handle = CommHandle::deferred([&] {
    ++runs;
    throw std::runtime_error("callback failed");
  });
  EXPECT_THROW(handle.wait(), std::runtime_error);
  EXPECT_FALSE(handle.pending()) << "a failed callback must not leave the handle pending";
  handle.wait();
  EXPECT_EQ(runs, 1) << "the callback runs once, also when it throws";
}

// One fault surfaces once: the parts after a failed one fail with it, without a wait of
// their own (a collective still in flight would wait out its timeout) or their callbacks.
TEST(CommHandle, AFailedPartFailsTheRestWithIt) {
  int later_part_runs = 0, combined_runs = 0;
  CommHandle failing = CommHandle::deferred([] { throw std::runtime_error("part failed"); });
  CommHandle later = CommHandle::deferred([&] { ++later_part_runs; });
  // Work that never completes: a collective whose peer is stuck.
  CommHandle stuck = CommHandle::from_work(c10::make_intrusive<c10d::Work>(), {},
                                           {.explain = [](const std::string&) -> std::string {
                                             ADD_FAILURE() << "a failed-with part reports";
                                             return "";
                                           }});
  CommHandle combined = CommHandle::after({failing, stuck, later}, [&] { ++combined_runs; });
  try {
    combined.wait();
    ADD_FAILURE() << "the part's error must reach the waiter";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "part failed");
  }
  EXPECT_EQ(later_part_runs, 0) << "parts after the failed one fail with it";
  EXPECT_EQ(combined_runs, 0) << "the combined callback would consume a failed result";
  EXPECT_FALSE(combined.pending());
  EXPECT_FALSE(stuck.pending()) << "the stuck collective is not waited for";
  EXPECT_FALSE(later.pending());
  combined.wait();
  EXPECT_EQ(combined_runs, 0);
}

}  // namespace
}  // namespace hp
