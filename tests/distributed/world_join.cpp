// Joins the world from the launch environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// HP_TIMEOUT_S, TORCHELASTIC_*), sums the ranks in one all-reduce and prints the result:
// the rank program of the start-up tests, which start ranks late, leave some out or point
// them at the wrong place, or have one come late to the all-reduce.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <thread>

#include "hyperparallel/collectives.h"
#include "hyperparallel/process_group.h"

int main() {
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> joined;
  try {
    const auto world = hp::World::from_env();
    joined = std::chrono::steady_clock::now();
    // WORLD_JOIN_MARK=FILE: this rank creates FILE once joined (for a test to act then).
    if (const char* mark = std::getenv("WORLD_JOIN_MARK")) std::fclose(std::fopen(mark, "w"));
    // WORLD_JOIN_STOP=1: this rank stops itself (SIGSTOP) once joined, as a frozen machine.
    if (const char* stop = std::getenv("WORLD_JOIN_STOP"); stop && std::string(stop) == "1") {
      raise(SIGSTOP);
    }
    // WORLD_JOIN_SLEEP_S: this rank comes to the all-reduce that many seconds late.
    if (const char* late = std::getenv("WORLD_JOIN_SLEEP_S")) {
      std::this_thread::sleep_for(std::chrono::duration<double>(std::stod(late)));
    }
    at::Tensor sum = at::full({1}, static_cast<double>(world->rank()), at::kFloat);
    hp::all_reduce(sum, hp::ReduceOp::kSum, *world->world_group()).wait();
    std::printf("rank %lld of %lld joined: rank sum %lld, timeout %lld ms\n",
                static_cast<long long>(world->rank()), static_cast<long long>(world->size()),
                static_cast<long long>(sum.item<float>()),
                static_cast<long long>(world->timeout().count()));
    return 0;
  } catch (const std::exception& error) {
    // The time inside the process: the tests bound it by the timeout, independent of
    // how long a loaded machine takes to start and end the process.
    const auto since = [](std::chrono::steady_clock::time_point t) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    };
    // what() itself, as a program that lets the error end it shows it: the library's named
    // failures carry no C++ backtrace (the tests check that none is printed).
    std::fprintf(stderr, "world_join: error: %s\nworld_join: failed after %.2f s", error.what(),
                 since(start));
    if (joined) std::fprintf(stderr, ", %.2f s after joining", since(*joined));
    std::fprintf(stderr, "\n");
    return 1;
  }
}
