#pragma once
// One handle type for "pending communication": either real c10d work, or no work at
// all (a group of size 1, or a state change deferred until someone needs it). Both may
// carry a completion callback that runs exactly once, at the first wait() — this is what
// lets a size-1 prefetch record a pending unshard without materialising anything early
// (seed 000), and what turns Gloo's SUM into a real average.

#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Work;
}

namespace hp {

class CommHandle {
 public:
  // A completed handle: wait() does nothing.
  CommHandle() = default;

  // Real communication; `on_complete` (optional) runs once after the work finished. When
  // the work fails, `on_failure` (optional) turns its message into the error wait() throws
  // (std::runtime_error), e.g. one naming the operation and the ranks that did not reach it.
  static CommHandle from_work(c10::intrusive_ptr<c10d::Work> work,
                              std::function<void()> on_complete = {},
                              std::function<std::string(const std::string&)> on_failure = {});

  // No communication; `on_complete` runs once, at the first wait().
  static CommHandle deferred(std::function<void()> on_complete);

  // Several handles as one: wait() waits each part, then runs `on_complete` once.
  static CommHandle after(std::vector<CommHandle> parts, std::function<void()> on_complete);

  // Blocks until the communication finished, then runs the completion callback if it
  // has not run yet. Safe to call any number of times, from copies of the handle too.
  // If the work, a part or the callback throws, this wait() rethrows it (after waiting
  // every part; the callback is skipped when its work failed) and the handle is done:
  // later waits do nothing.
  void wait();

  // True until wait() has run to its end: there is work or a callback still to consume.
  bool pending() const;

  // True while the handle stands for an actual collective not yet waited for (not a
  // no-op or deferred one).
  bool has_work() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace hp
