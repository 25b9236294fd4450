#include <gtest/gtest.h>

#include "hyperparallel/comm_handle.h"

namespace hp {
namespace {

TEST(CommHandle, DefaultHandleIsCompleted) {
  CommHandle handle;
  EXPECT_FALSE(handle.pending());
  EXPECT_FALSE(handle.has_work());
  handle.wait();
  handle.wait();
  EXPECT_FALSE(handle.pending());
}

TEST(CommHandle, DeferredCallbackRunsOnceAtFirstWait) {
  int runs = 0;
  CommHandle handle = CommHandle::deferred([&] { ++runs; });
  EXPECT_TRUE(handle.pending());
  EXPECT_FALSE(handle.has_work());
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

}  // namespace
}  // namespace hp
