// fully_shard against an independent single-process run of the same model on the
// global batch: fp32, two AdamW steps, loss, global grad norm, every gradient and every
// parameter within 1e-5. 1-D FSDP on 2 ranks and 2x2 HSDP on 4 ranks; uneven shapes on
// 2, 3 and 4 ranks; comm_fusion whole and in buckets.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

constexpr double kTol = 1e-5;

struct Setup {
  std::optional<DeviceMesh> mesh;
  bool comm_fusion = false;
  int64_t comm_fusion_bucket_bytes = 0;
};

void run_parity(const Setup& setup) {
  auto [reference, model] = testing::build_from_seed<Mlp>(42, 5, 7, 9, 3, 3);
  FullyShardOptions options;
  options.mesh = setup.mesh;
  options.comm_fusion = setup.comm_fusion;
  options.comm_fusion_bucket_bytes = setup.comm_fusion_bucket_bytes;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);

  auto next_batch = [] {
    at::Tensor x = torch::randn({12, 5}), y = torch::randn({12, 3});  // 12: divisible by 2, 3, 4
    return std::pair{x, y};
  };
  torch::manual_seed(7);
  testing::expect_training_matches_reference(reference, model, parts, /*steps=*/2, next_batch,
                                             testing::mse_loss, kTol);
}

HP_DIST_TEST(FullyShardParity, Fsdp1DUnevenShapes, 2, 3, 4) { run_parity({}); }

HP_DIST_TEST(FullyShardParity, Hsdp2x2, 4) {
  run_parity({DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}})});
}

HP_DIST_TEST(FullyShardParity, Hsdp2x2CommFusion, 4) {
  run_parity({DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}), true});
}

// Buckets of 96 bytes per peer: a parameter alone or with its neighbours, some larger
// than a bucket by themselves.
HP_DIST_TEST(FullyShardParity, CommFusionInBuckets, 2, 3) { run_parity({std::nullopt, true, 96}); }

HP_DIST_TEST(FullyShardParity, Hsdp2x2CommFusionInBuckets, 4) {
  run_parity({DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}), true, 96});
}

}  // namespace
}  // namespace hp
