#pragma once

#include <cstdint>
#include <utility>

#include "trainer/job.h"
#include "trainer/model_parts.h"
#include "trainer/train_options.h"

namespace hp::trainer {

// Steps with a non-finite loss or gradient norm on any rank make no update, on every rank;
// --max-skipped-steps of them in a row stop the run.
class SkippedSteps {
 public:
  SkippedSteps(const TrainOptions& o, int64_t rank) : limit_(o.max_skipped_steps), rank_(rank) {}

  // The step's mean loss over the ranks, and whether its update is to be made: one
  // all-reduce of the loss and of whether the norm was finite, so every rank decides alike.
  std::pair<double, bool> decide(const StepResult& result, int64_t step, const Job& job);

 private:
  int64_t limit_, rank_, in_a_row_ = 0, total_ = 0;
};

}  // namespace hp::trainer
