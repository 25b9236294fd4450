#pragma once
// Starts N local ranks of a command with a torchrun-compatible environment
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...),
// watches them, and tears all of them down when one fails or time runs out.
// Used by the `hp-run` program and by the multi-rank test harness.
//
// Like torchrun's agent, the launcher hosts the job's c10d TCPStore on MASTER_PORT itself
// for the whole launch and tells the ranks so (TORCHELASTIC_USE_AGENT_STORE=True; also
// TORCHELASTIC_RESTART_COUNT=0 unless given): any torchrun-style program runs under it,
// PyTorch's `init_process_group` included, and a rank's death takes no store with it.
//
// Each rank runs in its own process group, with stdin from /dev/null and stdout+stderr
// into a pipe read by the launcher. Teardown sends SIGTERM (or the signal being forwarded)
// to every remaining rank's process group (so a rank's own children stop too) and SIGKILL
// after a grace period: LaunchOptions::grace_period for a forwarded signal (a preempted
// job's ranks may be writing a last checkpoint), 2 s after a rank's failure or the timeout
// (the others cannot save without it).

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace hp {

struct LaunchOptions {
  int nprocs = 1;
  std::vector<std::string> command;  // argv; command[0] is looked up in PATH
  // Added to every rank's environment on top of ours; RANK, MASTER_PORT, ... win over it.
  std::map<std::string, std::string> extra_env;
  std::chrono::milliseconds timeout{0};  // 0: no limit
  std::string master_addr = "127.0.0.1";
  // Where the launcher hosts the store. 0: a free port of master_addr, bound before the
  // store listens on that very socket, so that nothing can take it meanwhile.
  int master_port = 0;
  // true: copy each rank's output lines to our stdout as "[rank K] line" as they come, and
  // print the launcher's own notices (a signal passed on, ranks killed) to stderr as
  // "[launcher] ..."; false: keep each rank's output (stdout and stderr merged) in
  // RankResult::output and print nothing.
  bool prefix_output = true;
  // After a forwarded SIGINT/SIGTERM/SIGHUP, how long the ranks may take to exit before
  // they are SIGKILLed; another such signal meanwhile kills them at once. 30 s, as
  // Kubernetes' terminationGracePeriodSeconds and torchrun's shutdown wait.
  std::chrono::milliseconds grace_period{std::chrono::seconds(30)};
};

struct RankResult {
  int rank = 0;
  int exit_code = 0;                // exit status, or 128 + signal number when killed by a signal
  bool killed_by_launcher = false;  // stopped for another rank's failure, timeout, interrupt
  std::string output;               // only filled when prefix_output is false
};

struct LaunchResult {
  // 0 when every rank exited 0; otherwise the exit code of the first rank that failed
  // (124 on timeout, like coreutils `timeout`; 128 + signal when interrupted, see below).
  int exit_code = 0;
  bool timed_out = false;
  // The signal forwarded to the ranks (see launch_local), or 0. Set when the caller survives
  // its re-raise: a handler of its own, or PID 1 of a container, where a signal without a
  // handler does nothing.
  int interrupted_by = 0;
  int first_failed_rank = -1;  // -1 when none failed
  std::vector<RankResult> ranks;
};

// Runs the ranks to completion. Throws c10::Error for bad options
// (nprocs < 1, empty command), when the store cannot be hosted (master_port in use) or when
// the processes cannot be started (e.g. the command cannot be executed); ranks already
// started are killed first.
//
// SIGINT, SIGTERM and SIGHUP received meanwhile (unless ignored) are forwarded to the
// ranks, which get options.grace_period to exit (a second signal: SIGKILL at once); once
// they are gone the signal is re-raised with the caller's disposition restored, so by
// default the process then dies of it. On Linux a rank is also SIGKILLed when the
// launching thread dies. SIGCHLD must not be ignored (SIG_IGN) by the caller.
LaunchResult launch_local(const LaunchOptions& options);

// A TCP port that was free on `addr` at the time of the call.
int find_free_port(const std::string& addr = "127.0.0.1");

}  // namespace hp
