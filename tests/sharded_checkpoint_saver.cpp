// Saves stepped checkpoints under a root forever, from a first step on, until it is
// killed: the process the killed-save test interrupts.
// Usage: sharded_checkpoint_saver ROOT FIRST_STEP
#include <cstdio>
#include <string>

#include "stepped_checkpoint.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s ROOT FIRST_STEP\n", argv[0]);
    return 2;
  }
  torch::nn::Sequential model = hp::testing::stepped_model();
  for (int64_t step = std::stoll(argv[2]);; ++step) hp::testing::save_step(model, argv[1], step);
}
