#include "trainer/run_checkpoints.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <vector>

#include "hyperparallel/collectives.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "trainer/preemption.h"
#include "trainer/usage_error.h"

namespace hp::trainer {
namespace {

// What a resumed run needs besides the model and the optimizer, saved with them: the
// steps taken (the data position) and every rank's random generator state.
hp::StateDict run_state(int64_t step, const hp::Group& all, int64_t ranks) {
  at::Tensor rng;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng = generator.get_state();
  }
  at::Tensor every_rng = torch::empty({ranks * rng.numel()}, rng.options());
  hp::all_gather(every_rng, rng, all).wait();
  hp::StateDict state;
  state.insert("step", at::scalar_tensor(step, at::kLong));
  state.insert("rng_states", every_rng.view({ranks, rng.numel()}));
  return state;
}

// This rank's generator state from a checkpoint; saved on another number of ranks, rank r
// takes row r modulo theirs.
void restore_rng(const at::Tensor& states, int64_t rank) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(states[rank % states.size(0)].clone());
}

// Checkpoints never hold inf or NaN weights: every rank checks its part, and all agree.
void require_finite_weights(torch::nn::Module& model, int64_t step, const Job& job) {
  at::Tensor non_finite = torch::zeros({}, torch::kLong);
  for (const auto& param : model.parameters()) {
    non_finite += param.detach().isfinite().logical_not().sum().cpu();
  }
  non_finite = non_finite.to(torch::kFloat).reshape({1});
  hp::all_reduce(non_finite, hp::ReduceOp::kSum, job.all()).wait();
  if (non_finite.item<double>() != 0) {
    C10_THROW_ERROR(Error, "after step " + std::to_string(step) + " the weights hold " +
                               std::to_string(static_cast<int64_t>(non_finite.item<double>())) +
                               " inf or NaN values: not saved (the latest checkpoint stays "
                               "the one to resume from); lower --lr or check the data");
  }
}

}  // namespace

std::string checkpoint_to_resume(const TrainOptions& o, int64_t rank) {
  if (o.resume != "auto") return o.resume;
  std::vector<std::string> damaged;
  const std::string latest = hp::latest_checkpoint(o.save, &damaged, o.resume_crc).value_or("");
  if (rank == 0) {
    for (const std::string& why : damaged) {
      std::printf("--resume auto: passing over a damaged checkpoint: %s\n", why.c_str());
    }
    if (latest.empty())
      std::printf("no complete checkpoint under %s: starting fresh\n", o.save.c_str());
  }
  return latest;
}

int64_t resume(const std::string& from, ModelParts& parts, torch::optim::AdamW& optimizer,
               int64_t rank) {
  torch::nn::Module& model = parts.loaded();
  int64_t done = 0;
  if (hp::is_complete_checkpoint(from)) {
    // Each rank reads only the pieces its shards need.
    const hp::StateDict state = hp::load_sharded_checkpoint(from, model, &optimizer);
    done = state["step"].item<int64_t>();
    restore_rng(state["rng_states"], rank);
    if (const at::Tensor* signal = state.find("last_words"); signal != nullptr && rank == 0) {
      std::printf("%s is the last-words checkpoint of a run stopped by %s\n", from.c_str(),
                  signal_name(signal->item<int>()).c_str());
    }
  } else if (std::filesystem::exists(from + "/model.pt")) {
    if (!parts.whole()) {
      throw UsageError("--resume " + from +
                       ": an --export loads into the whole model, not into pipeline stages; "
                       "resume it without --pp and --save a sharded checkpoint for --pp");
    }
    // An --export: both files stream, one tensor read at a time.
    hp::load_full_checkpoint(model, from + "/model.pt");
    hp::load_full_optimizer_checkpoint(model, optimizer, from + "/optim.pt");
    // AdamW counts steps per parameter; any parameter's count is the run's.
    auto state = optimizer.state().find(model.parameters().front().unsafeGetTensorImpl());
    if (state != optimizer.state().end()) {
      done = static_cast<torch::optim::AdamWParamState&>(*state->second).step();
    }
  } else {
    throw UsageError("--resume " + from +
                     ": neither a complete sharded checkpoint (no COMPLETE marker) nor an "
                     "--export directory (no model.pt)");
  }
  if (rank == 0) {
    std::printf("resumed from %s after %lld steps\n\n", from.c_str(), static_cast<long long>(done));
  }
  return done;
}

void save(const TrainOptions& o, int64_t step, ModelParts& parts, torch::optim::AdamW& optimizer,
          const Job& job, hp::AsyncCheckpointSaver* saver, int last_words) {
  torch::nn::Module& model = parts.saved();
  require_finite_weights(model, step, job);
  const std::string dir = hp::checkpoint_dir_for_step(o.save, step);
  hp::StateDict state = run_state(step, job.all(), job.ranks);
  if (last_words != 0) state.insert("last_words", at::scalar_tensor(last_words, at::kLong));
  if (saver) {
    saver->save(dir, model, &optimizer, state);
    if (job.rank == 0) std::printf("saving %s in the background\n", dir.c_str());
    return;
  }
  hp::save_sharded_checkpoint(dir, model, &optimizer, state);
  if (job.rank != 0) return;
  if (last_words == 0) {
    std::printf("saved %s\n", dir.c_str());
  } else {
    std::printf("preempted: last-words checkpoint at step %lld in %s\n",
                static_cast<long long>(step), dir.c_str());
  }
}

void export_full(const TrainOptions& o, ModelParts& parts, torch::optim::AdamW& optimizer,
                 const Job& job) {
  torch::nn::Module& model = parts.saved();
  require_finite_weights(model, o.steps, job);
  const std::string& dir = o.export_dir;
  if (parts.whole()) {
    hp::save_full_checkpoint(model, dir + "/model.pt");
    hp::save_full_optimizer_checkpoint(model, optimizer, dir + "/optim.pt");
  } else {
    const std::string sharded =
        o.save.empty() ? dir + "/.stages" : hp::checkpoint_dir_for_step(o.save, o.steps);
    if (o.save.empty()) hp::save_sharded_checkpoint(sharded, model, &optimizer);
    if (job.rank == 0) {
      hp::convert_to_full_checkpoint(sharded, dir + "/model.pt", dir + "/optim.pt");
      if (o.save.empty()) std::filesystem::remove_all(sharded);
    }
  }
  // The others wait for rank 0's files: a rank that exits first could have the launcher
  // stop rank 0 mid-write.
  hp::barrier(job.all()).wait();
  if (job.rank == 0)
    std::printf("exported %s/model.pt and %s/optim.pt\n", dir.c_str(), dir.c_str());
}

}  // namespace hp::trainer
