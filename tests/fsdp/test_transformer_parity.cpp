// fully_shard on the decoder-only transformer (models/transformer.h) against the
// single-process reference of the same class on the global batch: fp32, two AdamW
// steps, loss, global grad norm, every gradient and every parameter within 1e-5. The
// output projection is tied to the token embedding, which the root manages once.
// 1-D FSDP on 2 ranks and 2x2 HSDP on 4 ranks.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

constexpr double kTol = 1e-5;

// ffn_hidden is odd: w1, w3 and w2 shards are padded.
TransformerConfig tiny_config() {
  return {.vocab = 32, .dim = 16, .heads = 2, .layers = 2, .ffn_hidden = 25, .max_seq = 8};
}

void run_parity(const std::optional<DeviceMesh>& mesh) {
  auto [reference, model] = testing::build_from_seed<Transformer>(42, tiny_config());
  FullyShardOptions options;
  options.mesh = mesh;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);

  auto next_batch = [] {
    at::Tensor tokens = torch::randint(32, {8, 9}, torch::kLong);  // 8: divisible by 2 and 4
    return std::pair{tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8)};
  };
  torch::manual_seed(7);
  testing::expect_training_matches_reference(reference, model, parts, /*steps=*/2, next_batch,
                                             testing::token_cross_entropy, kTol,
                                             /*expect_every_param_managed=*/true);
}

HP_DIST_TEST(TransformerParity, Fsdp1D, 2) { run_parity(std::nullopt); }

HP_DIST_TEST(TransformerParity, Hsdp2x2, 4) {
  run_parity(DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}));
}

}  // namespace
}  // namespace hp
