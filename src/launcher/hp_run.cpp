// hp-run: starts N local ranks of a program with a torchrun-compatible environment and
// stops all of them as soon as one fails (see launcher.h); with
// --max-restarts, starts all of them again after a failure. SIGINT, SIGTERM and SIGHUP
// are passed on to the ranks, which get --grace-period seconds to exit.

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "launcher.h"

namespace {

constexpr int kUsageExit = 2;

constexpr const char* kDescription =
    "Starts N ranks of PROGRAM on this machine with RANK, LOCAL_RANK, WORLD_SIZE, "
    "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, prints their output as \"[rank K] "
    "line\", and stops every rank as soon as one fails. Like torchrun's agent, it hosts the "
    "job's TCPStore on MASTER_PORT itself (TORCHELASTIC_USE_AGENT_STORE=True), so any "
    "torchrun-style program runs under it.";

constexpr const char* kUsage = "usage: hp-run [OPTIONS] [--] PROGRAM [ARGS...]";

constexpr const char* kFooter =
    "PROGRAM and its arguments follow the options (after \"--\", or from the first argument "
    "that is not an option) and pass to every rank untouched.\n\n"
    "SIGINT, SIGTERM and SIGHUP are passed on to every rank, which then has --grace-period "
    "seconds to exit (e.g. to save a checkpoint) before SIGKILL; a second signal kills the "
    "ranks at once. Once they are gone hp-run dies of that signal itself (a shell shows "
    "128+N: 143 for SIGTERM, 130 for SIGINT) and restarts nothing.\n\n"
    "exit status: 0 when every rank succeeds, else the exit status of the first rank that "
    "failed (128+N for signal N), 124 on timeout, 2 on a usage error.";

struct Args {
  hp::LaunchOptions options;
  int max_restarts = 0;
  double timeout_s = 0;
  double grace_period_s = std::chrono::duration<double>(hp::LaunchOptions{}.grace_period).count();
  bool help = false;
  std::string help_text;
};

// Options come first; "--" or the first argument that is not an option starts the command,
// whose own arguments pass untouched. torchrun's underscore spellings are accepted.
Args parse_args(int argc, char** argv) {
  Args args;
  CLI::App app(kDescription, "hp-run");
  app.prefix_command();
  app.footer(kFooter);
  app.option_defaults()->always_capture_default();
  app.add_option("-n,--nproc-per-node,--nproc_per_node", args.options.nprocs, "number of ranks")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--max-restarts,--max_restarts", args.max_restarts,
                 "after a rank fails, stop the others and start all ranks again, up to N times; "
                 "each attempt sees TORCHELASTIC_RESTART_COUNT (0, 1, ...) as under torchrun, "
                 "so a program can resume from its newest checkpoint")
      ->check(CLI::Range(0, 1 << 16));
  const CLI::Validator finite(
      [](std::string& text) {
        return std::isfinite(std::strtod(text.c_str(), nullptr))
                   ? std::string()
                   : "must be a finite number, got '" + text + "'";
      },
      "FINITE");
  // The upper bounds keep the millisecond counts far from overflow.
  app.add_option("--timeout", args.timeout_s,
                 "kill all ranks after this many seconds, per attempt (a timeout is not "
                 "restarted); 0: no limit")
      ->check(finite)
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--grace-period,--grace_period", args.grace_period_s,
                 "seconds the ranks have to exit after a SIGINT/SIGTERM/SIGHUP passed on to "
                 "them (a preempted trainer saves its last checkpoint meanwhile) before "
                 "SIGKILL; as Kubernetes' default termination grace period")
      ->check(finite)
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--master-addr,--master_addr", args.options.master_addr, "rendezvous address")
      ->check([](const std::string& addr) { return addr.empty() ? "is empty" : ""; });
  app.add_option("--master-port,--master_port", args.options.master_port,
                 "where hp-run hosts the store; 0: a free port")
      ->check(CLI::Range(0, 65535));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    args.help = true;
    args.help_text = app.help();
    return args;
  } catch (const CLI::ParseError& error) {
    C10_THROW_ERROR(ValueError, error.what());
  }
  args.options.command = app.remaining();
  if (!args.options.command.empty() && args.options.command.front() == "--") {
    args.options.command.erase(args.options.command.begin());
  } else if (!args.options.command.empty() && args.options.command.front().starts_with("-")) {
    C10_THROW_ERROR(ValueError, "unknown option '" + args.options.command.front() + "'");
  }
  if (args.options.command.empty()) C10_THROW_ERROR(ValueError, "no program to run");
  if (args.timeout_s > 0) {
    // Rounded up so that a tiny positive timeout does not become 0 ("no limit").
    args.options.timeout =
        std::chrono::milliseconds(static_cast<long long>(std::ceil(args.timeout_s * 1000)));
  }
  args.options.grace_period =
      std::chrono::milliseconds(static_cast<long long>(std::ceil(args.grace_period_s * 1000)));
  return args;
}

void report_failure(const hp::LaunchResult& result, double timeout_s) {
  if (result.timed_out) {
    std::fprintf(stderr, "hp-run: timeout after %g s; killed all ranks\n", timeout_s);
    return;
  }
  if (result.first_failed_rank < 0) return;
  const bool killed_others =
      std::any_of(result.ranks.begin(), result.ranks.end(),
                  [](const hp::RankResult& r) { return r.killed_by_launcher; });
  std::fprintf(stderr, "hp-run: rank %d exited with code %d%s\n", result.first_failed_rank,
               result.ranks[result.first_failed_rank].exit_code,
               killed_others ? "; terminated the other ranks" : "");
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const c10::ValueError& e) {
    std::fprintf(stderr, "hp-run: %s\n%s\nTry 'hp-run --help' for more information.\n",
                 e.what_without_backtrace(), kUsage);
    return kUsageExit;
  }
  if (args.help) {
    std::fputs(args.help_text.c_str(), stdout);
    return 0;
  }
  try {
    args.options.extra_env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(args.max_restarts);
    for (int restart = 0;; ++restart) {
      args.options.extra_env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
      const hp::LaunchResult result = hp::launch_local(args.options);
      report_failure(result, args.timeout_s);
      // An interrupt is not restarted: hp-run survives the re-raised signal only as PID 1
      // of a container (no handler: the kernel drops it), and exits 128 + N instead.
      if (result.exit_code == 0 || result.timed_out || result.interrupted_by != 0 ||
          restart == args.max_restarts) {
        return result.exit_code;
      }
      std::fprintf(stderr, "hp-run: restarting all %d ranks (restart %d of %d)\n",
                   args.options.nprocs, restart + 1, args.max_restarts);
    }
  } catch (const c10::Error& e) {  // one line, not LibTorch's C++ backtrace
    std::fprintf(stderr, "hp-run: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hp-run: %s\n", e.what());
    return 1;
  }
}
