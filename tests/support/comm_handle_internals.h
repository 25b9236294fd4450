#pragma once
// Test-only view of a CommHandle: not part of the public API.

#include "hyperparallel/comm_handle.h"

namespace hp {

namespace detail {

// Befriended by CommHandle; only tests ask what a handle stands for, so it is defined here.
struct CommHandleAccess {
  static bool has_work(const CommHandle& handle) { return handle.has_work(); }
};

}  // namespace detail

namespace testing {

// True while `handle` (or one of its parts) stands for an actual collective not yet waited
// for (not a no-op or deferred one).
inline bool has_work(const CommHandle& handle) {
  return detail::CommHandleAccess::has_work(handle);
}

}  // namespace testing

}  // namespace hp
