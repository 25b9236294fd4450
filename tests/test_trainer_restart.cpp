// The trainer under hp-run's restarts: a run whose rank fails mid-way, restarted from its
// newest sharded checkpoint (--resume auto), ends with the checkpoint files of an
// uninterrupted run byte for byte; a save directory that cannot be written fails before
// the first step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "program_run.h"

#ifndef HP_RUN_PATH
#error "HP_RUN_PATH must name the hp-run executable"
#endif
#ifndef TRAIN_DECODER_PATH
#error "TRAIN_DECODER_PATH must name the train_decoder executable"
#endif

namespace hp::testing {
namespace {

namespace fs = std::filesystem;

// A small model on 2 ranks that learns the copy task in 40 steps.
ProgramRun train(const std::string& hp_run_flags, const std::string& trainer_flags) {
  return run_program(std::string(HP_RUN_PATH) + " -n 2 --timeout 120 " + hp_run_flags + " -- " +
                     TRAIN_DECODER_PATH +
                     " --mesh 1x2 --dim 32 --layers 2 --heads 2 --vocab 16 --seq 16 --batch 16"
                     " --steps 40 --lr 1e-2 --save-every 10 --resume auto " +
                     trainer_flags);
}

std::string contents(const fs::path& file) {
  std::ifstream stream(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("hp_trainer_" + std::to_string(getpid()));
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
};

TEST(TrainerRestart, RestartedRunEndsBitwiseEqualToUninterrupted) {
  TempDir dir;
  const std::string straight = (dir.path / "straight").string();
  const std::string restarted = (dir.path / "restarted").string();

  const ProgramRun reference = train("", "--save " + straight);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  EXPECT_TRUE(contains(reference.output, "no complete checkpoint under " + straight))
      << reference.output;

  // Rank 1 fails before step 25: the restart resumes from step 20.
  const ProgramRun run = train("--max-restarts 1", "--save " + restarted + " --fail-at-step 25");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const std::string& line : {std::string("--fail-at-step 25: failing on purpose"),
                                  std::string("hp-run: restarting all 2 ranks (restart 1 of 1)"),
                                  "resumed from " + restarted + "/step-00000020 after 20 steps",
                                  std::string("OK: the loss fell below half of its first value")}) {
    EXPECT_TRUE(contains(run.output, line)) << line << "\n" << run.output;
  }
  // The same summary: the resumed run carries the losses of the steps before.
  const auto summary = [](const std::string& output) {  // "loss A -> B"
    const size_t start = output.find("] loss ");
    return start == std::string::npos ? "" : output.substr(start, output.find(" (", start) - start);
  };
  ASSERT_NE(summary(reference.output), "") << reference.output;
  EXPECT_EQ(summary(run.output), summary(reference.output));

  const std::string last = "step-00000040";
  for (const char* file :
       {"index.json", "rank-00000.safetensors", "rank-00001.safetensors", "COMPLETE"}) {
    const fs::path expected = fs::path(straight) / last / file;
    ASSERT_TRUE(fs::exists(expected)) << expected;
    EXPECT_TRUE(contents(fs::path(restarted) / last / file) == contents(expected))
        << file << " differs from the uninterrupted run's";
  }
}

TEST(TrainerRestart, UnwritableSaveDirectoryFailsBeforeTraining) {
  TempDir dir;
  fs::create_directories(dir.path);
  std::ofstream(dir.path / "a_file") << "x";
  const std::string unwritable = (dir.path / "a_file" / "checkpoints").string();
  const ProgramRun run = train("", "--save " + unwritable);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "--save " + unwritable + ": rank 0 cannot write there"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "step ")) << run.output;
}

}  // namespace
}  // namespace hp::testing
