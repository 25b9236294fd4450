#pragma once
// Preemption: a cluster that takes a job's machines back sends SIGTERM and, a grace period
// later, SIGKILL (Kubernetes, Slurm; hp-run and torchrun pass the signal on to every
// rank). While a PreemptionWatch lives, SIGTERM and SIGINT only note the signal; at the
// end of each step the ranks agree whether any of them has one (they may see it at
// different steps), so that all stop after the same step and save one last checkpoint.
//
// The process ends at once, with status 128 + the first signal and without finishing a
// save in progress (that one stays "<dir>.partial", which is never loaded), when
//  - the grace period, counted from the first signal, runs out, or
//  - another signal comes at least kRepeatAfter after the first. Closer ones count as the
//    same signal: a cluster that signals every process and a launcher that passes the
//    signal on deliver it twice within milliseconds.

#include <chrono>
#include <string>

namespace hp {
class Group;
}

namespace hp::trainer {

// A second signal this long after the first means "exit now".
constexpr std::chrono::seconds kRepeatAfter{1};

class PreemptionWatch {
 public:
  // Catches SIGTERM and SIGINT; `grace` (> 0) bounds the time from the first signal to the
  // exit. One watch at a time per process; throws std::system_error when the timer cannot be
  // made.
  explicit PreemptionWatch(std::chrono::milliseconds grace);
  // Disarms the grace timer and restores the handlers there were before.
  ~PreemptionWatch();
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;

  // The signal any rank of `group` has caught (the highest number when they differ:
  // SIGTERM over SIGINT), or 0. A collective (one int all-reduced): call it on every rank
  // at the same point of each step.
  int agreed_signal(const Group& group) const;
};

// "SIGTERM", "SIGINT"; "signal N" for others.
std::string signal_name(int sig);

}  // namespace hp::trainer
