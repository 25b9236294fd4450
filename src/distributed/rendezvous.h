#pragma once
// Start-up that cannot hang: reaching (or hosting) the TCPStore on MASTER_ADDR:MASTER_PORT
// and waiting until every member of a group has arrived, each bounded by a deadline, with
// errors that name the step, the address and the ranks that did not arrive.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace hp {
struct LaunchEnv;
}

namespace hp::detail {

// A point in time and the allowance it came from (for messages).
struct Deadline {
  std::chrono::steady_clock::time_point at;
  std::chrono::milliseconds timeout;

  static Deadline after(std::chrono::milliseconds timeout);
  std::chrono::milliseconds remaining() const;  // zero once passed
};

struct StoreConnection {
  c10::intrusive_ptr<c10d::Store> store;
  std::string local_address;  // this machine's address towards MASTER_ADDR (for Gloo)
};

// Resolves MASTER_ADDR, then hosts the store (rank 0, unless torchrun's agent hosts it,
// see LaunchEnv::agent_store) or connects to it, by `deadline`; `deadline.timeout` also
// becomes the store's timeout for later waits. Under torchrun's agent store the keys of
// each attempt (TORCHELASTIC_RESTART_COUNT) are kept apart. Throws c10::DistNetworkError
// (c10::ValueError for a name that does not resolve) naming the variable or the
// rank at fault.
StoreConnection connect_store(const LaunchEnv& env, const Deadline& deadline);

// Marks `rank` arrived under `key_prefix` and waits until every rank of `ranks` (global
// ranks) has, by `deadline`. Throws c10::DistNetworkError naming `operation`, the ranks that
// did not arrive and how to raise the timeout. On a failed join every rank names the same
// missing ranks: the lowest rank's verdict, which it keeps answering for up to 2 s past
// its deadline so that ranks started later (their deadlines later) can still read it.
void await_ranks(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix,
                 const std::string& operation, const std::vector<int64_t>& ranks, int64_t rank,
                 const Deadline& deadline);

// Runs `work`, a start-up step whose store requests have no bound of their own once the
// store host stops (a TCPStore client whose wait timed out then waits forever for the
// host to cancel it; Gloo and NCCL connect through such waits), on a thread of its own.
// Past `deadline` and 2 s of grace it throws c10::DistNetworkError naming `operation` and
// the stopped store host, leaving the thread behind: `work` must capture by value.
void bounded_by_store(const std::string& operation, const Deadline& deadline,
                      std::function<void()> work);

// Every rank of `ranks` marks itself done under `key_prefix`; the lowest rank returns
// only once all have (by `deadline`, else c10::DistNetworkError naming the others). Once
// the store host (rank 0 when no launcher hosts it) has returned, no rank needs the store
// for the step any more, so a host that stops right after is named by the first
// collective that fails, not inside the step.
void leave_after_all(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix,
                     const std::string& operation, const std::vector<int64_t>& ranks, int64_t rank,
                     const Deadline& deadline);

// The error of a failed collective `what` (e.g. "all_reduce #12 over group 'world'") on
// `rank`, one of `ranks` (global ranks): reports the failure in the store under
// `key_prefix`, waits up to 2 s for the other members to report theirs, and names those
// that did not (stopped, crashed, or not at this collective: hung, or still computing).
// Its store calls are bounded (a stopped store host or a cut network is named as such).
// Only a group's first failed collective is reported: the later ones name it at once.
// `id` (empty: `what`) is what every member calls the collective: the same on each, where
// `what` may differ (a send on one side, its receive on the other).
std::string explain_failed_collective(const c10::intrusive_ptr<c10d::Store>& store,
                                      const std::string& key_prefix,
                                      const std::vector<int64_t>& ranks, int64_t rank,
                                      const std::string& what, const std::string& error,
                                      const std::string& id = "");

}  // namespace hp::detail
