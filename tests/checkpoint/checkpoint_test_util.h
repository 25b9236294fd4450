#pragma once
// What the checkpoint tests share: a small sharded transformer trained one step (so that
// parameters and optimizer state are no longer the initial ones), state dict comparison,
// and running a Python check.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/state_dict.h"
#include "models/transformer.h"

namespace hp::testing {

// Eight equal layers: the whole model is over 30 times its largest tensor.
inline models::TransformerConfig checkpoint_config() {
  models::TransformerConfig config;
  config.vocab = 64;
  config.dim = 64;
  config.heads = 4;
  config.layers = 8;
  config.ffn_hidden = 256;
  config.max_seq = 16;
  return config;
}

inline Sharded<models::Transformer> sharded_transformer(uint64_t seed,
                                                        const FullyShardOptions& options) {
  torch::manual_seed(seed);
  Sharded<models::Transformer> model(checkpoint_config());
  shard_blocks_then_root(model->layers, model, "layers.", options);
  return model;
}

// One AdamW step on this rank's own tokens.
inline void train_one_step(Sharded<models::Transformer>& model,
                           torch::optim::Optimizer& optimizer) {
  torch::manual_seed(100 + world()->rank());
  const at::Tensor tokens = torch::randint(checkpoint_config().vocab, {2, 9});
  optimizer.zero_grad();
  token_cross_entropy(model(tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8)).backward();
  optimizer.step();
}

inline void expect_equal_dicts(const StateDict& actual, const StateDict& expected) {
  ASSERT_EQ(actual.keys(), expected.keys());
  for (const auto& item : expected) {
    EXPECT_TRUE(torch::equal(actual[item.key()], item.value())) << item.key();
  }
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Runs `script` with python3; false when Python has no torch package (exit code 77).
inline bool run_python(const std::string& dir, const std::string& script) {
  const std::string file = dir + "/check.py";
  std::ofstream(file)
      << "import sys\ntry:\n    import torch\nexcept ImportError:\n    sys.exit(77)\n"
      << script;
  const int status = std::system(("python3 " + file).c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) return false;
  EXPECT_EQ(status, 0) << script;
  return true;
}

}  // namespace hp::testing
