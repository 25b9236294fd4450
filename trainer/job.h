#pragma once
// The job: this process's place in the world and the layout of the ranks.

#include <cstdint>
#include <memory>
#include <string>

#include "hyperparallel/process_group.h"
#include "trainer/parallel_layout.h"
#include "trainer/train_options.h"

namespace hp::trainer {

struct Job {
  std::shared_ptr<hp::World> world;
  ParallelLayout layout;
  int64_t rank = 0, ranks = 1;
  const hp::Group& all() const { return *world->world_group(); }
};

// Joins the world and divides its ranks as the options ask. A layout the ranks cannot
// make is a usage error, found before any connection where the launch environment shows it.
Job join_job(const TrainOptions& o);

// Fails before training, on every rank, when rank 0 cannot write into `dir` (a write
// error at the first save would waste the steps before it).
void check_writable(const std::string& flag, const std::string& dir, const Job& job);

}  // namespace hp::trainer
