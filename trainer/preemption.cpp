#include "trainer/preemption.h"

#include <ATen/ATen.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "hyperparallel/collectives.h"
#include "hyperparallel/process_group.h"

namespace hp::trainer {
namespace {

constexpr std::array<int, 2> kCaught = {SIGTERM, SIGINT};

// What the handlers share. Atomics (lock-free, so usable in a handler), since the handler
// may run on any thread of the process.
std::atomic<int> g_signal{0};             // the first caught; 0: none yet
std::atomic<int64_t> g_first_at_ns{0};    // CLOCK_MONOTONIC time of the first
std::atomic<bool> g_watching{false};      // one watch at a time
timer_t g_grace_timer{};                  // fires SIGALRM when the grace period ends
itimerspec g_grace{};                     // one shot
std::array<char, 256> g_grace_message{};  // built beforehand: a handler cannot format
constexpr const char* kRepeatMessage =
    "train_decoder: a second signal: exiting now, without the last-words checkpoint\n";
static_assert(std::atomic<int64_t>::is_always_lock_free);

int64_t monotonic_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

[[noreturn]] void exit_now(const char* message) {
  (void)!write(STDERR_FILENO, message, std::strlen(message));
  _exit(128 + g_signal.load());
}

void on_signal(int sig) {
  const int64_t now = monotonic_ns();
  int first = 0;
  if (g_signal.compare_exchange_strong(first, sig)) {
    g_first_at_ns.store(now);
    timer_settime(g_grace_timer, 0, &g_grace, nullptr);  // async-signal-safe
    return;
  }
  // 0: the first signal's handler is still running (on another thread): the same signal.
  const int64_t first_at = g_first_at_ns.load();
  if (first_at == 0 || now - first_at < std::chrono::nanoseconds(kRepeatAfter).count()) return;
  exit_now(kRepeatMessage);
}

void on_grace_over(int) { exit_now(g_grace_message.data()); }

// The handlers replaced (kCaught's, then SIGALRM's), restored by the destructor.
std::array<struct sigaction, kCaught.size() + 1> g_previous{};

void install(int sig, void (*handler)(int), struct sigaction* previous) {
  struct sigaction action{};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  for (int other : kCaught) sigaddset(&action.sa_mask, other);
  action.sa_flags = SA_RESTART;  // a read or write the signal interrupts goes on
  sigaction(sig, &action, previous);
}

}  // namespace

PreemptionWatch::PreemptionWatch(std::chrono::milliseconds grace) {
  if (grace.count() <= 0) throw std::invalid_argument("the grace period must be positive");
  if (g_watching.exchange(true)) throw std::logic_error("a PreemptionWatch is already active");
  sigevent event{};
  event.sigev_notify = SIGEV_SIGNAL;
  event.sigev_signo = SIGALRM;
  if (timer_create(CLOCK_MONOTONIC, &event, &g_grace_timer) != 0) {
    g_watching = false;
    throw std::system_error(errno, std::generic_category(),
                            "cannot create the grace period's timer");
  }
  g_grace.it_value.tv_sec = grace.count() / 1000;
  g_grace.it_value.tv_nsec = grace.count() % 1000 * 1'000'000;
  std::snprintf(g_grace_message.data(), g_grace_message.size(),
                "train_decoder: the grace period of %g s after the signal ran out: exiting now, "
                "without the last-words checkpoint\n",
                static_cast<double>(grace.count()) / 1000);
  g_signal = 0;
  g_first_at_ns = 0;
  install(SIGALRM, on_grace_over, &g_previous[kCaught.size()]);
  for (size_t i = 0; i < kCaught.size(); ++i) {
    // An ignored signal stays ignored (a launcher started in the background has SIGINT
    // ignored, and passes that on to its ranks).
    sigaction(kCaught[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler != SIG_IGN) install(kCaught[i], on_signal, nullptr);
  }
}

PreemptionWatch::~PreemptionWatch() {
  for (size_t i = 0; i < kCaught.size(); ++i) sigaction(kCaught[i], &g_previous[i], nullptr);
  timer_delete(g_grace_timer);  // disarms it
  sigaction(SIGALRM, &g_previous[kCaught.size()], nullptr);
  g_watching = false;
}

int PreemptionWatch::agreed_signal(const Group& group) const {
  at::Tensor caught = at::full({1}, g_signal.load(), at::kInt);
  all_reduce(caught, ReduceOp::kMax, group).wait();
  return caught.item<int>();
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    default:
      return "signal " + std::to_string(sig);
  }
}

}  // namespace hp::trainer
