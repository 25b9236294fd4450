// Checkpoints saved in the background (AsyncCheckpointSaver): training goes on while the
// files are written, and the checkpoint holds the state at the save, not what training
// made of it since; a write that fails on one rank is reported on every rank, at the
// next save or at wait(), and leaves the previous checkpoint as the newest. (A rank killed
// during a background write: ShardedCheckpoint.KilledAsyncSaveLeavesACompleteCheckpoint.)
#include <signal.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "checkpoint_test_util.h"
#include "error_of.h"
#include "hyperparallel/async_checkpoint.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "shared_dir.h"

namespace hp::testing {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

const char* name_of(CheckpointStaging staging) {
  return staging == CheckpointStaging::kFork ? "forked snapshot" : "staging copy";
}

// Rank 0 also writes 64 MiB of extras, so that writing takes several training steps.
void expect_training_goes_on_while_the_snapshot_is_written(CheckpointStaging staging) {
  auto world = testing::world();
  Sharded<models::Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const StateDict saved_model = get_full_state_dict(*model);
  const StateDict saved_optim = get_full_optimizer_state_dict(*model, opt);
  StateDict extra;
  extra.insert("step", at::scalar_tensor(1, at::kLong));
  extra.insert("ballast", torch::rand({16 << 20}));

  const std::string dir = shared_dir("hp_async_checkpoint");
  const std::string checkpoint = checkpoint_dir_for_step(dir, 1);
  AsyncCheckpointSaver saver(staging);
  const auto save_started = Clock::now();
  saver.save(checkpoint, *model, &opt, extra);
  const double blocked = seconds_since(save_started);
  // The same number of steps on both ranks (they are collectives); counted when they
  // begin while the write is under way (how many end before it finishes depends on the
  // disk's speed against the step's).
  int steps_while_writing = 0;
  for (int step = 0; step < 5; ++step) {
    steps_while_writing += saver.busy();
    train_one_step(model, opt);
  }
  extra["ballast"].zero_();
  saver.wait();
  const double written = seconds_since(save_started);
  std::printf(
      "rank %lld, %s: save() blocked %.3f s; written after %.3f s; %d of 5 steps began while "
      "writing\n",
      static_cast<long long>(world->rank()), name_of(staging), blocked, written,
      steps_while_writing);
  if (world->rank() == 0) EXPECT_GE(steps_while_writing, 1);
  EXPECT_FALSE(saver.busy());

  // The checkpoint holds the state at save(), not the 5 steps after it.
  Sharded<models::Transformer> loaded = sharded_transformer(7, {});
  torch::optim::AdamW loaded_opt(loaded->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(loaded, loaded_opt);  // creates the optimizer state to load into
  const StateDict loaded_extra = load_sharded_checkpoint(checkpoint, *loaded, &loaded_opt);
  expect_equal_dicts(get_full_state_dict(*loaded), saved_model);
  expect_equal_dicts(get_full_optimizer_state_dict(*loaded, loaded_opt), saved_optim);
  EXPECT_GT(loaded_extra["ballast"].abs().sum().item<double>(), 0) << "staged, not referenced";
  remove_after_all_ranks(dir);
}

HP_DIST_TEST(AsyncCheckpoint, TrainingGoesOnWhileTheSnapshotIsWritten, 2) {
  for (CheckpointStaging staging : {CheckpointStaging::kFork, CheckpointStaging::kCopy}) {
    SCOPED_TRACE(name_of(staging));
    expect_training_goes_on_while_the_snapshot_is_written(staging);
  }
}

// Rank 1 may write only small files (RLIMIT_FSIZE, as on a full disk: its write fails).
void expect_a_failed_write_reported_on_every_rank(CheckpointStaging staging) {
  auto world = testing::world();
  Sharded<models::Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const std::string dir = shared_dir("hp_async_failed");
  const std::string first = checkpoint_dir_for_step(dir, 1);
  AsyncCheckpointSaver saver(staging);
  saver.save(first, *model, &opt);
  saver.wait();

  rlimit unlimited{};
  getrlimit(RLIMIT_FSIZE, &unlimited);
  if (world->rank() == 1) {
    signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of killing the process
    rlimit small = unlimited;
    small.rlim_cur = 4096;
    setrlimit(RLIMIT_FSIZE, &small);
  }
  const auto expect_reported = [&](const std::string& error) {
    if (world->rank() == 1) {
      EXPECT_TRUE(contains(error, "rank-00001.safetensors")) << error;
    } else {
      EXPECT_TRUE(contains(error, "failed on rank(s) 1")) << error;
    }
  };
  // At wait() ...
  const std::string second = checkpoint_dir_for_step(dir, 2);
  saver.save(second, *model, &opt);
  train_one_step(model, opt);
  expect_reported(error_of([&] { saver.wait(); }));
  EXPECT_FALSE(fs::exists(second));
  EXPECT_EQ(latest_checkpoint(dir), first);
  // ... and at the next save, which then does not start.
  const std::string third = checkpoint_dir_for_step(dir, 3);
  saver.save(second, *model, &opt);
  train_one_step(model, opt);
  expect_reported(error_of([&] { saver.save(third, *model, &opt); }));
  EXPECT_FALSE(saver.busy());
  EXPECT_FALSE(fs::exists(third));

  if (world->rank() == 1) setrlimit(RLIMIT_FSIZE, &unlimited);
  saver.save(third, *model, &opt);
  saver.wait();
  EXPECT_EQ(latest_checkpoint(dir), third);
  EXPECT_EQ(error_of([&] { load_sharded_checkpoint(first, *model, &opt); }), "no error");
  remove_after_all_ranks(dir);
}

HP_DIST_TEST(AsyncCheckpoint, AFailedWriteIsReportedOnEveryRank, 2) {
  for (CheckpointStaging staging : {CheckpointStaging::kFork, CheckpointStaging::kCopy}) {
    SCOPED_TRACE(name_of(staging));
    expect_a_failed_write_reported_on_every_rank(staging);
  }
}

}  // namespace
}  // namespace hp::testing
