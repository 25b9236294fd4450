// hp-run: starts N local ranks of a program with a torchrun-compatible environment and
// stops all of them as soon as one fails (see hyperparallel/launcher.h); with
// --max-restarts, starts all of them again after a failure.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "hyperparallel/launcher.h"

namespace {

constexpr int kUsageExit = 2;

constexpr const char* kUsageLine =
    "usage: hp-run [-n N] [--max-restarts N] [--timeout SECONDS] [--master-addr ADDR] "
    "[--master-port PORT] [--] PROGRAM [ARGS...]\n";

constexpr const char* kHelp =
    "\n"
    "Starts N ranks of PROGRAM on this machine with RANK, LOCAL_RANK, WORLD_SIZE,\n"
    "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, prints their output as\n"
    "\"[rank K] line\", and stops every rank as soon as one fails.\n"
    "\n"
    "options:\n"
    "  -n, --nproc-per-node N  number of ranks (default 1)\n"
    "  --max-restarts N        after a rank fails, stop the others and start all ranks\n"
    "                          again, up to N times (default 0); each attempt sees\n"
    "                          TORCHELASTIC_RESTART_COUNT (0, 1, ...) as under torchrun, so\n"
    "                          a program can resume from its newest checkpoint\n"
    "  --timeout SECONDS       kill all ranks after this long, per attempt; a timeout is\n"
    "                          not restarted (default 0: no limit)\n"
    "  --master-addr ADDR      rendezvous address (default 127.0.0.1)\n"
    "  --master-port PORT      rendezvous port (default: a free port)\n"
    "  -h, --help              show this help\n"
    "\n"
    "exit status: 0 when every rank succeeds, else the exit status of the first rank that\n"
    "failed (128+N for signal N), 124 on timeout, 2 on a usage error.\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  hp::LaunchOptions options;
  int max_restarts = 0;
  double timeout_s = 0;
  bool help = false;
};

int parse_int(std::string_view flag, std::string_view text, int min, int max) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
    throw UsageError(std::string(flag) + " needs an integer in " + std::to_string(min) + ".." +
                     std::to_string(max) + ", got '" + std::string(text) + "'");
  }
  return value;
}

double parse_seconds(std::string_view flag, std::string_view text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  // The upper bound keeps the millisecond count far from overflow.
  if (ec != std::errc() || end != text.data() + text.size() || !(value >= 0 && value <= 1e9)) {
    throw UsageError(std::string(flag) + " needs a number of seconds in 0..1e9, got '" +
                     std::string(text) + "'");
  }
  return value;
}

// Options come first; "--" or the first argument that is not an option starts the command.
// Long options also accept "--name=value" and torchrun's underscore spellings.
Args parse_args(int argc, char** argv) {
  Args args;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;

    std::string name(arg);
    std::optional<std::string_view> attached;
    if (arg.starts_with("--")) {
      if (const size_t eq = arg.find('='); eq != std::string_view::npos) {
        name = arg.substr(0, eq);
        attached = arg.substr(eq + 1);
      }
      std::replace(name.begin() + 2, name.end(), '_', '-');
    } else if (arg.starts_with("-n") && arg.size() > 2) {
      name = "-n";
      attached = arg.substr(2);
    }
    auto value = [&]() -> std::string_view {
      if (attached) return *attached;
      if (i + 1 >= argc) throw UsageError("option " + name + " needs a value");
      return argv[++i];
    };

    if (name == "-h" || name == "--help") {
      args.help = true;
    } else if (name == "-n" || name == "--nproc-per-node") {
      args.options.nprocs = parse_int(name, value(), 1, 1 << 16);
    } else if (name == "--max-restarts") {
      args.max_restarts = parse_int(name, value(), 0, 1 << 16);
    } else if (name == "--timeout") {
      args.timeout_s = parse_seconds(name, value());
    } else if (name == "--master-addr") {
      args.options.master_addr = value();
      if (args.options.master_addr.empty()) throw UsageError("--master-addr is empty");
    } else if (name == "--master-port") {
      args.options.master_port = parse_int(name, value(), 0, 65535);
    } else {
      throw UsageError("unknown option '" + std::string(arg) + "'");
    }
  }
  args.options.command.assign(argv + i, argv + argc);
  if (!args.help && args.options.command.empty()) throw UsageError("no program to run");
  if (args.timeout_s > 0) {
    // Rounded up so that a tiny positive timeout does not become 0 ("no limit").
    args.options.timeout =
        std::chrono::milliseconds(static_cast<long long>(std::ceil(args.timeout_s * 1000)));
  }
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
  } catch (const UsageError& e) {
    std::fprintf(stderr, "hp-run: %s\n%sTry 'hp-run --help' for more information.\n", e.what(),
                 kUsageLine);
    return kUsageExit;
  }
  if (args.help) {
    std::fputs(kUsageLine, stdout);
    std::fputs(kHelp, stdout);
    return 0;
  }
  try {
    args.options.extra_env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(args.max_restarts);
    for (int restart = 0;; ++restart) {
      args.options.extra_env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
      const hp::LaunchResult result = hp::launch_local(args.options);
      report_failure(result, args.timeout_s);
      if (result.exit_code == 0 || result.timed_out || restart == args.max_restarts) {
        return result.exit_code;
      }
      std::fprintf(stderr, "hp-run: restarting all %d ranks (restart %d of %d)\n",
                   args.options.nprocs, restart + 1, args.max_restarts);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hp-run: %s\n", e.what());
    return 1;
  }
}
