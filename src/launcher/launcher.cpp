// Local multi-process launcher: the job's TCPStore hosted here, fork+exec of N ranks, one
// output pipe per rank, a poll() loop that forwards output and watches exits, and
// process-group teardown on failure, timeout or interrupt (a forwarded signal, with the
// caller's grace period).

#include "launcher.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

extern char** environ;

namespace hp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPollInterval = std::chrono::milliseconds(50);
// How long a rank may take to shut down after SIGTERM for another rank's failure or the
// timeout, before it is SIGKILLed. (A forwarded signal gets LaunchOptions::grace_period.)
constexpr auto kKillGrace = std::chrono::seconds(2);
// After every rank has exited, output still in flight is read for at most this long; a
// pipe held open longer (by a grandchild that left the rank's process group) is abandoned.
constexpr auto kDrainTime = std::chrono::milliseconds(250);
// A prefixed "line" is cut here so a rank that never prints '\n' cannot grow memory.
constexpr size_t kMaxPartialLine = 64 * 1024;
constexpr size_t kReadChunk = 64 * 1024;

[[noreturn]] void fail(const std::string& what) {
  C10_THROW_ERROR(Error, "hp::launch_local: " + what);
}

[[noreturn]] void fail_errno(const std::string& what, int err) {
  fail(what + ": " + std::strerror(err));
}

// Ranks run in their own process groups, so a Ctrl-C on the terminal reaches only the
// launcher. While a launch runs, SIGINT/SIGTERM/SIGHUP are caught here (the poll loop
// checks the count), forwarded to the ranks, and re-raised once the ranks are gone.
constexpr std::array<int, 3> kForwardedSignals = {SIGINT, SIGTERM, SIGHUP};
// The latest signal caught and how many were: a second one means "stop now". Atomics,
// since the handler may run on any thread (the store's too).
std::atomic<int> g_caught_signal{0};
std::atomic<int> g_signals_caught{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler needs lock-free atomics");

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

void on_forwarded_signal(int sig) {
  g_caught_signal.store(sig);
  g_signals_caught.fetch_add(1);
}

// Installs the handlers for the lifetime of the object; nested or concurrent launches
// share one installation.
class SignalForwarding {
 public:
  SignalForwarding() {
    std::lock_guard lock(mutex_);
    if (users_++ > 0) return;
    g_caught_signal.store(0);
    g_signals_caught.store(0);
    struct sigaction action{};
    action.sa_handler = on_forwarded_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (size_t i = 0; i < kForwardedSignals.size(); ++i) {
      sigaction(kForwardedSignals[i], nullptr, &previous_[i]);
      // An ignored signal (e.g. under nohup) stays ignored, for us and for the ranks.
      installed_[i] = previous_[i].sa_handler != SIG_IGN;
      if (installed_[i]) sigaction(kForwardedSignals[i], &action, nullptr);
    }
  }

  ~SignalForwarding() {
    std::lock_guard lock(mutex_);
    if (--users_ > 0) return;
    for (size_t i = 0; i < kForwardedSignals.size(); ++i) {
      if (installed_[i]) sigaction(kForwardedSignals[i], &previous_[i], nullptr);
    }
  }

  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  static inline std::mutex mutex_;
  static inline int users_ = 0;
  static inline std::array<struct sigaction, kForwardedSignals.size()> previous_{};
  static inline std::array<bool, kForwardedSignals.size()> installed_{};
};

// The caller's environment; the first definition of a name wins, as for getenv.
std::map<std::string, std::string> inherited_environment() {
  std::map<std::string, std::string> env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq != nullptr) env.emplace(std::string(*entry, eq - *entry), std::string(eq + 1));
  }
  return env;
}

// The paths execvp would try for `name`, resolved before fork because execvp itself is not
// async-signal-safe. PATH comes from the ranks' environment, as with torchrun.
std::vector<std::string> exec_candidates(const std::string& name,
                                         const std::map<std::string, std::string>& env) {
  if (name.find('/') != std::string::npos) return {name};
  auto path_it = env.find("PATH");
  const std::string path = path_it != env.end() ? path_it->second : "/bin:/usr/bin";
  std::vector<std::string> candidates;
  size_t begin = 0;
  while (true) {
    const size_t end = path.find(':', begin);
    std::string dir = path.substr(begin, end == std::string::npos ? end : end - begin);
    candidates.push_back((dir.empty() ? "." : dir) + "/" + name);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return candidates;
}

std::vector<char*> c_array(std::vector<std::string>& strings) {
  std::vector<char*> array;
  for (std::string& s : strings) array.push_back(s.data());
  array.push_back(nullptr);
  return array;
}

// Owns a file descriptor.
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    return *this;
  }
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Both ends close on exec, so no rank inherits another rank's pipe.
std::pair<UniqueFd, UniqueFd> make_pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) fail_errno("cannot create a pipe", errno);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

int exit_code_of(const siginfo_t& info) {
  return info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
}

// Set for every rank, as torchrun's agent sets it: the store is ours, the ranks connect.
constexpr const char* kAgentStore = "TORCHELASTIC_USE_AGENT_STORE";
// Programs under an agent store keep each attempt's keys apart by it (PyTorch requires it).
constexpr const char* kRestartCount = "TORCHELASTIC_RESTART_COUNT";

// A socket bound to `port` of `addr` (0: a free one), close-on-exec and not listening, and
// the port. IPv4 addresses come first: ranks reach MASTER_ADDR over IPv4 (rendezvous.cpp).
std::pair<UniqueFd, int> bind_port(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
      rc != 0) {
    C10_THROW_ERROR(Error, "cannot resolve '" + addr + "': " + gai_strerror(rc));
  }
  std::vector<const addrinfo*> candidates;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) candidates.push_back(ai);
  std::stable_partition(candidates.begin(), candidates.end(),
                        [](const addrinfo* ai) { return ai->ai_family == AF_INET; });
  int err = 0;
  UniqueFd bound_fd;
  int bound_port = -1;
  for (const addrinfo* ai : candidates) {
    UniqueFd fd(socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    // As TCPStore's own listener: a port of a run that just ended (TIME_WAIT) is free.
    const int on = 1;
    if (fd.get() >= 0) setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (fd.get() >= 0 && bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      bound_port = bound.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                       : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
      bound_fd = std::move(fd);
      break;
    }
    err = errno;
  }
  freeaddrinfo(found);
  if (bound_port < 0) {
    C10_THROW_ERROR(Error, "cannot bind to '" + addr + "' port " + std::to_string(port) + ": " +
                               std::strerror(err));
  }
  return {std::move(bound_fd), bound_port};
}

struct Rank {
  pid_t pid = -1;       // also its process group id; -1 once reaped
  UniqueFd out;         // read end of its stdout+stderr pipe; closed at EOF
  bool exited = false;  // seen with WNOWAIT: the zombie keeps the group id reserved
  std::string partial;  // prefix mode: text after the last newline
};

class Launch {
 public:
  explicit Launch(const LaunchOptions& options) : options_(options) {
    result_.ranks.resize(options.nprocs);
    ranks_.resize(options.nprocs);
    for (int r = 0; r < options.nprocs; ++r) result_.ranks[r].rank = r;
  }

  // Only reached with live ranks when an exception cut the launch short.
  ~Launch() {
    for (Rank& rank : ranks_) {
      if (rank.pid > 0) {
        kill(-rank.pid, SIGKILL);
        while (waitpid(rank.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
    }
  }

  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  LaunchResult run() {
    start_ranks();
    const auto started = Clock::now();
    std::optional<Clock::time_point> all_exited_at;
    while (true) {
      observe_exits();
      const auto now = Clock::now();
      if (const int caught = g_signals_caught.load(); caught > signals_seen_) {
        signals_seen_ = caught;
        const int sig = g_caught_signal.load();
        if (interrupted_by_ == 0) interrupted_by_ = sig;
        if (!teardown_at_) {
          begin_teardown(sig, options_.grace_period);
          announce(std::string(signal_name(sig)) + " passed on to the ranks, which have " +
                   seconds_text(options_.grace_period) +
                   " to exit before SIGKILL (another signal: at once)");
        } else {  // a second signal, or one during a failure's teardown: the user means now
          kill_remaining(std::string("another ") + signal_name(sig));
        }
      } else if (!teardown_at_) {
        if (result_.first_failed_rank >= 0) {
          begin_teardown(SIGTERM, kKillGrace);
        } else if (options_.timeout.count() > 0 && now - started >= options_.timeout) {
          result_.timed_out = true;
          begin_teardown(SIGTERM, kKillGrace);
        }
      } else if (!sigkill_sent_ && now - *teardown_at_ >= kill_after_) {
        kill_remaining(interrupted_by_ != 0
                           ? "the grace period of " + seconds_text(kill_after_) + " ran out"
                           : "");
      }
      if (all_exited()) {
        if (!all_exited_at) {
          all_exited_at = now;
          // A torn-down job leaves nothing behind: every group id is still reserved by its
          // unreaped leader, so this cannot hit an unrelated process.
          if (teardown_at_) {
            for (Rank& rank : ranks_) kill(-rank.pid, SIGKILL);
          }
        }
        if (!any_pipe_open() || now - *all_exited_at >= kDrainTime) break;
      }
      poll_output();
    }
    finish();
    return result_;
  }

 private:
  void start_ranks() {
    auto env = inherited_environment();
    for (const auto& [key, value] : options_.extra_env) env.insert_or_assign(key, value);
    const int port = host_store();
    const std::string world = std::to_string(options_.nprocs);
    env.insert_or_assign("WORLD_SIZE", world);
    env.insert_or_assign("LOCAL_WORLD_SIZE", world);
    env.insert_or_assign("ROLE_WORLD_SIZE", world);
    env.insert_or_assign("GROUP_RANK", "0");
    env.insert_or_assign("MASTER_ADDR", options_.master_addr);
    env.insert_or_assign("MASTER_PORT", std::to_string(port));
    env.insert_or_assign(kAgentStore, "True");
    env.try_emplace(kRestartCount, "0");

    std::vector<std::string> args = options_.command;
    std::vector<char*> argv = c_array(args);
    std::vector<std::string> paths = exec_candidates(options_.command[0], env);
    std::vector<char*> path_ptrs = c_array(paths);

    // Ranks read /dev/null: in their own process groups they could not read a terminal.
    const UniqueFd null_fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (null_fd.get() < 0) fail_errno("cannot open /dev/null", errno);
    for (int r = 0; r < options_.nprocs; ++r) {
      const std::string rank = std::to_string(r);
      env.insert_or_assign("RANK", rank);
      env.insert_or_assign("LOCAL_RANK", rank);
      env.insert_or_assign("ROLE_RANK", rank);
      std::vector<std::string> entries;
      for (const auto& [key, value] : env) entries.push_back(key + "=" + value);
      std::vector<char*> envp = c_array(entries);
      start_rank(r, argv.data(), envp.data(), path_ptrs.data(), null_fd.get());
    }
  }

  // Hosts the job's TCPStore on MASTER_PORT, as torchrun's agent does, and returns the port.
  // Every rank is a client, so a rank that exits or stops takes no store with it. A port
  // chosen here is bound first and the store listens on that very socket: nothing else can
  // take the port in between (a bind of port 0 elsewhere could take a port only found free).
  int host_store() {
    c10d::TCPStoreOptions store_options;
    store_options.isServer = true;
    store_options.waitWorkers = false;
    store_options.numWorkers = static_cast<size_t>(options_.nprocs);
    store_options.useLibUV = false;  // also the ranks' choice (rendezvous.cpp)
    store_options.port = static_cast<uint16_t>(options_.master_port);
    try {
      // TCPStore binds its own listener to every interface (IPv4 and IPv6), whatever the
      // address, and the store has no authentication: hand it a socket bound to
      // master_addr alone, the given port or a free one.
      auto [socket, port] = bind_port(options_.master_addr, options_.master_port);
      store_options.port = static_cast<uint16_t>(port);
      store_options.masterListenFd = socket.release();  // the store closes it
      store_ = c10::make_intrusive<c10d::TCPStore>(options_.master_addr, store_options);
    } catch (const c10::Error& error) {
      fail("cannot host the store on " + options_.master_addr + ":" +
           std::to_string(store_options.port) + " (" + error.what_without_backtrace() +
           "); pick a free --master-port, or 0 for one chosen here");
    }
    return store_options.port;
  }

  void start_rank(int r, char* const argv[], char* const envp[], char* const paths[], int null_fd) {
    auto [out_read, out_write] = make_pipe();
    // Carries the child's exec errno; closes without data when exec succeeds.
    auto [status_read, status_write] = make_pipe();
    sigset_t no_signals;
    sigemptyset(&no_signals);
#ifdef __linux__
    const pid_t launcher = getpid();
#endif

    const pid_t pid = fork();
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      setpgid(0, 0);
#ifdef __linux__
      // Die with the launcher even when it is SIGKILLed and cannot tear down.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(127);
#endif
      // A mask blocked by the calling thread must not make the rank deaf to SIGTERM.
      sigprocmask(SIG_SETMASK, &no_signals, nullptr);
      dup2(null_fd, STDIN_FILENO);
      dup2(out_write.get(), STDOUT_FILENO);
      dup2(out_write.get(), STDERR_FILENO);
      int err = ENOENT;
      for (char* const* path = paths; *path != nullptr; ++path) {
        execve(*path, argv, envp);
        // Like execvp: keep searching past missing files, remember permission errors.
        if (errno == EACCES) {
          err = EACCES;
        } else if (errno != ENOENT && errno != ENOTDIR) {
          err = errno;
          break;
        }
      }
      (void)!write(status_write.get(), &err, sizeof err);
      _exit(127);
    }

    if (pid < 0) {
      const int err = errno;
      fail_errno("fork failed for rank " + std::to_string(r), err);
    }
    out_write.reset();
    status_write.reset();
    // The child has called setpgid by the time this returns, so kill(-pid) is valid after.
    int exec_errno = 0;
    ssize_t n;
    while ((n = read(status_read.get(), &exec_errno, sizeof exec_errno)) < 0 && errno == EINTR) {
    }
    ranks_[r].pid = pid;
    if (n > 0) fail_errno("cannot execute '" + options_.command[0] + "'", exec_errno);
    fcntl(out_read.get(), F_SETFL, fcntl(out_read.get(), F_GETFL) | O_NONBLOCK);
    ranks_[r].out = std::move(out_read);
  }

  void observe_exits() {
    for (int r = 0; r < options_.nprocs; ++r) {
      Rank& rank = ranks_[r];
      if (rank.exited) continue;
      siginfo_t info{};
      if (waitid(P_PID, rank.pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
        const int err = errno;
        if (err == EINTR) continue;
        fail_errno("cannot watch rank " + std::to_string(r) + " (is SIGCHLD ignored?)", err);
      }
      if (info.si_pid == 0) continue;
      rank.exited = true;
      result_.ranks[r].exit_code = exit_code_of(info);
      if (result_.ranks[r].exit_code != 0 && !teardown_at_ && result_.first_failed_rank < 0) {
        result_.first_failed_rank = r;
      }
    }
  }

  void begin_teardown(int sig, std::chrono::milliseconds kill_after) {
    teardown_at_ = Clock::now();
    kill_after_ = kill_after;
    for (int r = 0; r < options_.nprocs; ++r) {
      if (ranks_[r].exited) continue;
      result_.ranks[r].killed_by_launcher = true;
      kill(-ranks_[r].pid, sig);
    }
  }

  // SIGKILL for every rank still running; `why`, when given, is announced with their list.
  void kill_remaining(const std::string& why) {
    std::string running;
    for (int r = 0; r < options_.nprocs; ++r) {
      if (ranks_[r].exited) continue;
      kill(-ranks_[r].pid, SIGKILL);
      running += (running.empty() ? "" : ", ") + std::to_string(r);
    }
    sigkill_sent_ = true;
    if (!why.empty() && !running.empty()) announce(why + ": killed rank(s) " + running);
  }

  // A notice of the launcher's own beside the ranks' prefixed output (prefix mode only).
  void announce(const std::string& text) const {
    if (!options_.prefix_output) return;
    std::fprintf(stderr, "[launcher] %s\n", text.c_str());
    std::fflush(stderr);
  }

  static std::string seconds_text(std::chrono::milliseconds duration) {
    char text[32];
    std::snprintf(text, sizeof text, "%g s", static_cast<double>(duration.count()) / 1000);
    return text;
  }

  bool all_exited() const {
    for (const Rank& rank : ranks_) {
      if (!rank.exited) return false;
    }
    return true;
  }

  bool any_pipe_open() const {
    for (const Rank& rank : ranks_) {
      if (rank.out.get() >= 0) return true;
    }
    return false;
  }

  void poll_output() {
    std::vector<pollfd> fds;
    std::vector<int> owners;
    for (int r = 0; r < options_.nprocs; ++r) {
      if (ranks_[r].out.get() < 0) continue;
      fds.push_back({ranks_[r].out.get(), POLLIN, 0});
      owners.push_back(r);
    }
    const int ready = poll(fds.data(), fds.size(), static_cast<int>(kPollInterval.count()));
    if (ready <= 0) return;  // timeout, or EINTR from a signal the loop will look at
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) read_chunk(owners[i]);
    }
  }

  // One read per wakeup, so a chatty rank cannot starve the exit and timeout checks.
  void read_chunk(int r) {
    Rank& rank = ranks_[r];
    char buffer[kReadChunk];
    const ssize_t n = read(rank.out.get(), buffer, sizeof buffer);
    if (n > 0) {
      consume(r, std::string_view(buffer, n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      rank.out.reset();
      if (!rank.partial.empty()) emit_lines(r, "\n");
    }
  }

  void consume(int r, std::string_view data) {
    if (!options_.prefix_output) {
      result_.ranks[r].output.append(data);
      return;
    }
    emit_lines(r, data);
    if (ranks_[r].partial.size() >= kMaxPartialLine) emit_lines(r, "\n");
  }

  // Writes the complete lines of partial+data as "[rank K] line"; keeps the remainder.
  void emit_lines(int r, std::string_view data) {
    std::string& partial = ranks_[r].partial;
    partial.append(data);
    const std::string prefix = "[rank " + std::to_string(r) + "] ";
    std::string out;
    size_t begin = 0;
    for (size_t end; (end = partial.find('\n', begin)) != std::string::npos; begin = end + 1) {
      out.append(prefix).append(partial, begin, end + 1 - begin);
    }
    partial.erase(0, begin);
    if (out.empty()) return;
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fflush(stdout);
  }

  void finish() {
    for (Rank& rank : ranks_) {
      while (waitpid(rank.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      rank.pid = -1;
      rank.out.reset();
    }
    for (int r = 0; r < options_.nprocs; ++r) {
      if (!ranks_[r].partial.empty()) emit_lines(r, "\n");
    }
    result_.interrupted_by = interrupted_by_;
    if (interrupted_by_ != 0) {
      result_.exit_code = 128 + interrupted_by_;
    } else if (result_.timed_out) {
      result_.exit_code = 124;
    } else if (result_.first_failed_rank >= 0) {
      result_.exit_code = result_.ranks[result_.first_failed_rank].exit_code;
    }
  }

  const LaunchOptions& options_;
  c10::intrusive_ptr<c10d::TCPStore> store_;  // outlives the ranks (destroyed after them)
  LaunchResult result_;
  std::vector<Rank> ranks_;
  std::optional<Clock::time_point> teardown_at_;
  std::chrono::milliseconds kill_after_{0};  // from teardown_at_ to SIGKILL
  bool sigkill_sent_ = false;
  int signals_seen_ = 0;
  int interrupted_by_ = 0;
};

}  // namespace

LaunchResult launch_local(const LaunchOptions& options) {
  if (options.nprocs < 1) fail("nprocs must be at least 1, got " + std::to_string(options.nprocs));
  if (options.command.empty() || options.command[0].empty()) fail("the command is empty");
  if (options.timeout.count() < 0) fail("the timeout must not be negative");
  if (options.grace_period.count() < 0) fail("the grace period must not be negative");
  if (options.master_port < 0 || options.master_port > 65535) {
    fail("master_port must be in 0..65535, got " + std::to_string(options.master_port));
  }
  LaunchResult result;
  {
    SignalForwarding forwarding;
    Launch launch(options);
    result = launch.run();
  }
  // The ranks are gone; now let the interrupt do what the caller had arranged for it.
  if (result.interrupted_by != 0) raise(result.interrupted_by);
  return result;
}

int find_free_port(const std::string& addr) {
  try {
    return bind_port(addr, 0).second;
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(Error, std::string("hp::find_free_port: ") + error.what_without_backtrace());
  }
}

}  // namespace hp
