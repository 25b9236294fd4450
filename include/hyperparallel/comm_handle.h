#pragma once
// One handle type for "pending communication": either real c10d work, or no work at
// all (a group of size 1, or a state change deferred until someone needs it). Both may
// carry a completion callback that runs exactly once, at the first wait() — this is what
// lets a size-1 prefetch record a pending unshard without materialising anything early
// (it materialises from the latest shard), and what turns Gloo's SUM into a real average.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class Work;
}

namespace hp {

namespace detail {
struct CommHandleAccess;
}  // namespace detail

// How a collective fails (the library's collectives make it for their group).
struct CommFailure {
  // Turns the backend's message into the error wait() throws (unset: the message as is),
  // e.g. one naming the operation and the ranks that did not reach it.
  std::function<std::string(const std::string&)> explain;
  // Past this, wait() counts the collective as failed (unset: the backend decides). Gloo
  // starts an operation's timeout only when a worker thread takes it up, so one queued
  // behind a stuck operation would otherwise wait a timeout of its own after that one.
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

class CommHandle {
 public:
  // A completed handle: wait() does nothing.
  CommHandle() = default;

  // Real communication; `on_complete` (optional) runs once after the work finished. When
  // the work fails or misses `failure.deadline`, wait() throws c10::DistBackendError with the
  // message `failure.explain` makes.
  static CommHandle from_work(c10::intrusive_ptr<c10d::Work> work,
                              std::function<void()> on_complete = {}, CommFailure failure = {});

  // No communication; `on_complete` runs once, at the first wait().
  static CommHandle deferred(std::function<void()> on_complete);

  // Several handles as one: wait() waits each part, then runs `on_complete` once.
  static CommHandle after(std::vector<CommHandle> parts, std::function<void()> on_complete);

  // Blocks until the communication finished, then runs the completion callback if it
  // has not run yet. Safe to call any number of times, from copies of the handle too.
  // If the work, a part or the callback throws, this wait() rethrows the first error and
  // the handle is done: later waits do nothing. The callback is skipped when its work
  // failed, and the parts after a failed one fail with it: no wait for each to time out,
  // no report of its own, no callback (collectives still in flight keep their buffers).
  // Destroying the last copy of a pending handle does not wait: the collective finishes
  // on its own, but the callback never runs and a failure is never reported.
  void wait();

  // True until wait() has run to its end: there is work or a callback still to consume.
  bool pending() const;

 private:
  friend struct detail::CommHandleAccess;  // tests ask has_work() (tests/support)
  struct State;
  // True while the handle stands for an actual collective not yet waited for (not a
  // no-op or deferred one).
  bool has_work() const;
  // Waits for the work, by the failure deadline when there is one.
  void wait_for_work();
  // Marks the handle done and returns the callback it had, not yet run.
  std::function<void()> finish();
  // Done without waiting: in-flight work is kept alive (never freed), callbacks dropped.
  void abandon();

  std::shared_ptr<State> state_;
};

}  // namespace hp
