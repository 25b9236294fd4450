// Saves stepped checkpoints under a root forever, from a first step on, until it is
// killed: the ranks the killed-save tests interrupt. Run under hp-run, every rank writes
// its shards of the fully_shard-ed model; rank 0 writes its pid to ROOT/rank0.pid. With
// --async, an AsyncCheckpointSaver writes them in the background (from forked writers).
// Usage: hp-run -n N -- sharded_checkpoint_saver ROOT FIRST_STEP [--async]
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "hyperparallel/async_checkpoint.h"
#include "hyperparallel/fully_shard.h"
#include "stepped_checkpoint.h"

int main(int argc, char** argv) {
  const bool async = argc == 4 && std::string(argv[3]) == "--async";
  if (argc != 3 && !async) {
    std::fprintf(stderr, "usage: %s ROOT FIRST_STEP [--async]\n", argv[0]);
    return 2;
  }
  hp::Sharded<torch::nn::Sequential> model(hp::testing::stepped_model());
  hp::fully_shard(model);
  if (hp::default_world()->rank() == 0) {
    std::ofstream(std::string(argv[1]) + "/rank0.pid.partial") << getpid() << "\n";
    std::rename((std::string(argv[1]) + "/rank0.pid.partial").c_str(),
                (std::string(argv[1]) + "/rank0.pid").c_str());
  }
  // The forked writer: a killed rank must take its writer process with it.
  hp::AsyncCheckpointSaver saver(hp::CheckpointStaging::kFork);
  const hp::testing::SaveCheckpoint save_in_background =
      [&saver](const std::string& dir, torch::nn::Module& module, const hp::StateDict& extra) {
        saver.save(dir, module, nullptr, extra);
      };
  for (int64_t step = std::stoll(argv[2]);; ++step) {
    hp::testing::save_step(model, argv[1], step,
                           async ? save_in_background : hp::testing::save_synchronously);
  }
}
