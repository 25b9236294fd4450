#pragma once
// Fault injection for restart tests (--fail-at-step, --fail-rank, --fail-by-kill): one
// failure per attempt, the attempt being TORCHELASTIC_RESTART_COUNT.

#include <cstdint>

#include "trainer/train_options.h"

namespace hp::trainer {

struct InjectedFault {
  int64_t before_step = 0;  // 0: none in this attempt
  int64_t rank = 0;
};

// This attempt's fault (the attempt: TORCHELASTIC_RESTART_COUNT).
InjectedFault fault_of_this_attempt(const TrainOptions& o, int64_t ranks);

// Fails on purpose (an exception, or SIGKILL with `by_kill`) when `step` is the fault's
// and this is its rank.
void fail_if_due(const InjectedFault& fault, int64_t step, int64_t rank, bool by_kill);

}  // namespace hp::trainer
