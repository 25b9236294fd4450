#include "trainer/job.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "hyperparallel/collectives.h"
#include "hyperparallel/launch_env.h"
#include "trainer/usage_error.h"

namespace hp::trainer {

Job join_job(const TrainOptions& o) {
  hp::WorldOptions world_options;
  if (o.timeout > 0) {
    world_options.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout * 1000)));
  }
  const hp::LaunchEnv launch = hp::LaunchEnv::from_environment();
  try {
    check_world_size(o, launch.world_size);
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  std::shared_ptr<hp::World> world = hp::World::create(launch, world_options);
  try {
    ParallelLayout layout = make_parallel_layout(world, o);
    return Job{world, std::move(layout), world->rank(), world->size()};
  } catch (const c10::ValueError& error) {  // the mesh refused the layout
    throw UsageError(error.what_without_backtrace());
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
}

void check_writable(const std::string& flag, const std::string& dir, const Job& job) {
  std::string problem;
  if (job.rank == 0) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    const std::string probe = dir + "/.write-test";
    if (error) {
      problem = error.message();
    } else if (!(std::ofstream(probe) << "x")) {
      problem = "cannot create files in it";
    }
    std::filesystem::remove(probe, error);
  }
  at::Tensor failed = torch::full({1}, problem.empty() ? 0 : 1, torch::kInt);
  hp::all_reduce(failed, hp::ReduceOp::kMax, job.all()).wait();
  if (failed.item<int>() != 0) {
    throw UsageError(flag + " " + dir + ": rank 0 cannot write there" +
                     (problem.empty() ? "" : " (" + problem + ")") + "; pick a writable directory");
  }
}

}  // namespace hp::trainer
