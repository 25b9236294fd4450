#include "trainer/fault_injection.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "trainer/usage_error.h"

namespace hp::trainer {

InjectedFault fault_of_this_attempt(const TrainOptions& o, int64_t ranks) {
  const char* restart_count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const size_t attempt = restart_count == nullptr ? 0 : std::stoul(restart_count);
  InjectedFault fault;
  fault.before_step = attempt < o.fail_at_steps.size() ? o.fail_at_steps[attempt] : 0;
  fault.rank =
      o.fail_ranks.empty() || attempt >= o.fail_ranks.size() ? ranks - 1 : o.fail_ranks[attempt];
  if (fault.before_step > 0 && fault.rank >= ranks) {
    throw UsageError("--fail-rank " + std::to_string(fault.rank) + ": there are only " +
                     std::to_string(ranks) + " ranks");
  }
  return fault;
}

void fail_if_due(const InjectedFault& fault, int64_t step, int64_t rank, bool by_kill) {
  if (step != fault.before_step || rank != fault.rank) return;
  std::printf("--fail-at-step %lld: rank %lld fails on purpose (fault injection)\n",
              static_cast<long long>(step), static_cast<long long>(rank));
  std::fflush(stdout);
  if (by_kill) raise(SIGKILL);
  throw std::runtime_error("--fail-at-step " + std::to_string(step) +
                           ": failing on purpose (fault injection)");
}

}  // namespace hp::trainer
