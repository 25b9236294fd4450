// fully_shard against an independent single-process run of the same model on the
// global batch: fp32, two AdamW steps, loss, global grad norm, every gradient and every
// parameter within 1e-5. 1-D FSDP on 2 ranks and 2x2 HSDP on 4 ranks; uneven shapes on
// 2, 3 and 4 ranks.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

constexpr double kTol = 1e-5;

struct Setup {
  std::optional<DeviceMesh> mesh;
  bool comm_fusion = false;
};

void run_parity(const Setup& setup) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  torch::manual_seed(42);
  Mlp reference(5, 7, 9, 3, 3);
  torch::manual_seed(42);
  Sharded<Mlp> model(5, 7, 9, 3, 3);

  FullyShardOptions options;
  options.mesh = setup.mesh;
  options.comm_fusion = setup.comm_fusion;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor x = torch::randn({12, 5}), y = torch::randn({12, 3});  // 12: divisible by 2, 3, 4
    ref_opt.zero_grad();
    at::Tensor ref_loss = torch::mse_loss(reference(x), y);
    ref_loss.backward();

    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(model(testing::local_batch(x, rank, ranks)),
                                      testing::local_batch(y, rank, ranks));
    loss.backward();

    at::Tensor mean_loss = loss.detach().clone();
    all_reduce(mean_loss, ReduceOp::kAvg, *world->world_group()).wait();
    EXPECT_NEAR(mean_loss.item<double>(), ref_loss.item<double>(), kTol) << "loss";
    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(ref_grads), kTol) << "grad norm";
    testing::expect_all_close(grads, ref_grads, kTol, "grad");

    ref_opt.step();
    opt.step();
    testing::expect_all_close(testing::full_params(parts), testing::reference_params(*reference),
                              kTol, "param after step");
  }
}

HP_DIST_TEST(FullyShardParity, Fsdp1DUnevenShapes, 2, 3, 4) { run_parity({}); }

HP_DIST_TEST(FullyShardParity, Hsdp2x2, 4) {
  run_parity({DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}})});
}

HP_DIST_TEST(FullyShardParity, Hsdp2x2CommFusion, 4) {
  run_parity({DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}), true});
}

}  // namespace
}  // namespace hp
