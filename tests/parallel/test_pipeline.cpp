// Pipeline parallelism composed with fully_shard (test plan L2-09): 4 ranks as 2
// pipeline stages x 2 data-parallel ranks, each stage fully_shard-ed over its two
// data-parallel ranks, GPipe over microbatches. Against the single-process model on the
// global batch: loss, every gradient and the gradient at the stage boundary within 1e-5,
// with one gradient reduction per step whatever the number of microbatches.
// Every multi-rank test has the harness's timeout, so a deadlock fails instead of hanging.
#include <torch/torch.h>

#include <chrono>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/pipeline.h"
#include "hyperparallel/trace.h"
#include "models/mlp.h"
#include "shared_dir.h"
#include "stopped_rank.h"

namespace hp {
namespace {

using models::Mlp;
using models::MlpBlock;
using testing::error_of;

constexpr int64_t kBlocks = 4, kBlocksPerStage = 2;

// One stage of the MLP: the input projection (first stage), two blocks, the head (last
// stage), with the parameters of the whole model's blocks [first_block, first_block + 2).
struct MlpStageImpl : torch::nn::Module {
  MlpStageImpl(Mlp& whole, int64_t stage) {
    torch::NoGradGuard no_grad;
    auto copy = [](torch::nn::Linear from) {
      torch::nn::Linear to(from->options);
      to->weight.copy_(from->weight);
      to->bias.copy_(from->bias);
      return to;
    };
    if (stage == 0) input = register_module("input", copy(whole->input));
    for (int64_t i = 0; i < kBlocksPerStage; ++i) {
      auto& from = whole->blocks[stage * kBlocksPerStage + i];
      MlpBlock block(from->fc1->options.in_features(), from->fc1->options.out_features());
      block->fc1 = block->replace_module("fc1", copy(from->fc1));
      block->fc2 = block->replace_module("fc2", copy(from->fc2));
      blocks.emplace_back(block);
      register_module("block" + std::to_string(i), blocks.back().ptr());
    }
    if (stage == 1) head = register_module("head", copy(whole->head));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = input ? input(x) : x;
    for (auto& block : blocks) h = block(h);
    return head ? head(h) : h;
  }
  torch::nn::Linear input{nullptr}, head{nullptr};
  std::vector<Sharded<MlpBlock>> blocks;
};
TORCH_MODULE(MlpStage);

HP_DIST_TEST(Pipeline, L2_09_TwoStagesTimesTwoFsdpMatchesReference, 4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}});
  const int64_t stage = mesh.coordinate("pp"), dp = mesh.coordinate("dp_shard");
  const bool first = stage == 0, last = stage == 1;
  for (int64_t microbatches : {1, 2, 4}) {
    SCOPED_TRACE("microbatches " + std::to_string(microbatches));
    torch::manual_seed(42);
    Mlp reference(5, 8, 9, 3, kBlocks);
    Sharded<MlpStage> stage_module(MlpStage(reference, stage));
    testing::ShardedParts parts;
    FullyShardOptions options;
    options.mesh = mesh.slice({"dp_shard"});
    for (int64_t i = 0; i < kBlocksPerStage; ++i) {
      parts.emplace_back("blocks." + std::to_string(stage * kBlocksPerStage + i) + ".",
                         fully_shard(stage_module->blocks[i], options));
    }
    parts.emplace_back("", fully_shard(stage_module, options));
    GPipeSchedule schedule({.forward = [&](const at::Tensor& x) { return stage_module(x); },
                            .group = mesh.group("pp"),
                            .fsdp = stage_module.fsdp()},
                           microbatches, testing::mse_loss);

    torch::manual_seed(7);
    at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
    // The reference, with the boundary activation's gradient (after block 1).
    at::Tensor boundary = reference->blocks[1](reference->blocks[0](reference->input(x)));
    boundary.retain_grad();
    at::Tensor h = boundary;
    for (int64_t i = kBlocksPerStage; i < kBlocks; ++i) h = reference->blocks[i](h);
    at::Tensor ref_loss = torch::mse_loss(reference->head(h), y);
    ref_loss.backward();

    trace::start();
    const PipelineStepResult result =
        schedule.step(first ? testing::local_batch(x, dp, 2) : at::Tensor(),
                      last ? testing::local_batch(y, dp, 2) : at::Tensor());
    // Gradients are reduced once per step (in the last microbatch's backward), not once
    // per microbatch: one reduce-scatter per fully_shard-ed module.
    int64_t reduce_scatters = 0;
    for (const auto& event : trace::stop()) {
      reduce_scatters += trace::describe(event).starts_with("RS issue");
    }
    EXPECT_EQ(reduce_scatters, static_cast<int64_t>(parts.size()));
    if (last) {
      at::Tensor mean_loss = result.loss.clone();
      all_reduce(mean_loss, ReduceOp::kAvg, *mesh.group("dp_shard")).wait();
      EXPECT_NEAR(mean_loss.item<double>(), ref_loss.item<double>(), 1e-5) << "loss";
    }
    // This rank's loss averages over its half of the batch: its boundary gradient is
    // twice its half of the global one.
    const at::Tensor expected_boundary = 2 * testing::local_batch(boundary.grad(), dp, 2);
    const at::Tensor& boundary_grad = first ? result.output_grads[0] : result.input_grads[0];
    ASSERT_TRUE(boundary_grad.defined());
    EXPECT_TRUE(torch::allclose(boundary_grad, expected_boundary, 0, 1e-5))
        << "stage boundary gradient";
    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_EQ(grads.size(), 10u) << "this stage's parameters: 2 blocks and the input or the head";
    for (const auto& [name, grad] : grads) {
      EXPECT_TRUE(torch::allclose(grad, ref_grads.at(name), 0, 1e-5)) << "grad " << name;
    }
  }
}

HP_DIST_TEST(Pipeline, BadArgumentsAreReported, 2) {
  auto world = testing::world();
  const bool first = world->rank() == 0;
  GPipeSchedule schedule(
      {.forward = [](const at::Tensor& x) { return x * 2; }, .group = world->world_group()}, 3,
      testing::mse_loss);
  const std::string error = error_of([&] {
    schedule.step(first ? torch::ones({4, 2}) : at::Tensor(),
                  first ? at::Tensor() : torch::ones({4, 2}));
  });
  EXPECT_NE(error.find("is not divisible into 3 microbatches"), std::string::npos) << error;
  EXPECT_NE(error_of([] { GPipeSchedule({}, 1, testing::mse_loss); }).find("has no forward"),
            std::string::npos);
}

// A stage that stops (SIGSTOP: a frozen process or machine) is named by both neighbours
// within the timeout + 3 s: the transfer (stage, pass, microbatch, direction), the peer's
// world rank, and that the peer did not see it fail, not Gloo's bare timeout. The stopped
// stage is resumed afterwards and fails too.
HP_DIST_TEST(Pipeline, AStoppedStageIsNamedByItsNeighbours, 3) {
  constexpr auto kTimeout = std::chrono::seconds(2);
  auto world = World::from_env(WorldOptions{kTimeout});
  const int64_t rank = world->rank();
  at::Tensor weight = torch::ones({2}, torch::requires_grad());
  GPipeSchedule schedule(
      {.forward = [&](const at::Tensor& x) { return x * weight; }, .group = world->world_group()},
      2, testing::mse_loss);
  const auto step = [&] {
    schedule.step(rank == 0 ? torch::ones({4, 2}) : at::Tensor(),
                  rank == 2 ? torch::ones({4, 2}) : at::Tensor());
  };
  step();  // every connection made
  testing::StoppedRank stopped(testing::shared_dir("hp_stopped_stage"), "pipeline");
  if (rank == 1) {
    stopped.stop_here();
    EXPECT_NE(error_of(step), "no error") << "the others gave up on this step";
    return;
  }
  ASSERT_TRUE(stopped.wait_until_stopped());
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of(step);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Stage 0 sent both microbatches' activations and waits for the first gradient; stage 2
  // waits for the activations' shape, which comes before the first microbatch.
  const std::string transfer =
      rank == 0 ? "pipeline stage 0, backward of microbatch 0: receiving its output gradient "
                  "from stage 1 (recv from world rank 1 over group 'world') failed"
                : "pipeline stage 2, forward of microbatch 0: receiving the activations' shape "
                  "from stage 1 (recv from world rank 1 over group 'world') failed";
  EXPECT_NE(error.find(transfer), std::string::npos) << error;
  EXPECT_NE(error.find("world rank 1 did not report the same failure"), std::string::npos) << error;
  EXPECT_LT(seconds, 2.0 + 3.0) << error;
  stopped.done(rank, /*resumer=*/0, {2});
}

}  // namespace
}  // namespace hp
