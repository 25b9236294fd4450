// The communication schedule of the overlap design, checked as the exact
// order of collective issues and waits — not timing. 4-block model, 2x2 HSDP.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/trace.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

struct Run {
  std::vector<std::string> schedule;
  std::map<std::string, at::Tensor> grads;
};

// Two steps (the first teaches the implicit prefetch order); the second is traced.
Run traced_step(bool implicit_prefetch) {
  torch::manual_seed(42);
  Sharded<Mlp> model(5, 8, 9, 3, 4);
  FullyShardOptions options;
  options.mesh = DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}});
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  FSDPModule root = parts.back().second;
  root.set_implicit_prefetch(implicit_prefetch);
  auto world = testing::world();
  Run run;
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(step);
    at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
    root.zero_grad();
    if (step == 1) trace::start();
    torch::mse_loss(model(testing::local_batch(x, world->rank(), 4)),
                    testing::local_batch(y, world->rank(), 4))
        .backward();
    if (step == 1) {
      for (const auto& event : trace::stop()) run.schedule.push_back(trace::describe(event));
    }
  }
  run.grads = testing::full_grads(parts);
  return run;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

HP_DIST_TEST(Schedule, ForwardAndBackwardOrderMatchesTheDesign, 4) {
  const Run run = traced_step(/*implicit_prefetch=*/true);
  const std::vector<std::string> expected = {
      // Forward: issue this block's all-gather (unless prefetched) and the next one's,
      // then wait for this one; compute; reshard at once.
      "forward begin root", "AG issue root", "AG issue blocks.0", "AG wait root", "AG done root",
      "forward begin blocks.0", "AG issue blocks.1", "AG wait blocks.0", "AG done blocks.0",
      "forward end blocks.0",  //
      "forward begin blocks.1", "AG issue blocks.2", "AG wait blocks.1", "AG done blocks.1",
      "forward end blocks.1",  //
      "forward begin blocks.2", "AG issue blocks.3", "AG wait blocks.2", "AG done blocks.2",
      "forward end blocks.2",  //
      "forward begin blocks.3", "AG wait blocks.3", "AG done blocks.3", "forward end blocks.3",
      "forward end root",
      // Backward: the root (kept unsharded) prefetches the last block.
      "backward begin root", "AG issue blocks.3", "backward begin blocks.3", "AG issue blocks.2",
      "AG wait blocks.3", "AG done blocks.3",
      // Post-backward pipeline: (1) wait the previous reduce-scatter, (2) apply it for
      // pure FSDP, (3) issue this one, (4) issue the previous all-reduce.
      "backward end blocks.3", "RS issue blocks.3", "backward begin blocks.2", "AG issue blocks.1",
      "AG wait blocks.2", "AG done blocks.2", "backward end blocks.2", "RS wait blocks.3",
      "RS done blocks.3", "RS issue blocks.2", "AR issue blocks.3", "backward begin blocks.1",
      "AG issue blocks.0", "AG wait blocks.1", "AG done blocks.1", "backward end blocks.1",
      "RS wait blocks.2", "RS done blocks.2", "RS issue blocks.1", "AR issue blocks.2",
      "backward begin blocks.0", "AG wait blocks.0", "AG done blocks.0", "backward end blocks.0",
      "RS wait blocks.1", "RS done blocks.1", "RS issue blocks.0", "AR issue blocks.1",
      // End of backward (root): its own reduction, the last all-reduce, then every
      // all-reduce waited once, in issue order.
      "backward end root", "RS wait blocks.0", "RS done blocks.0", "RS issue root",
      "AR issue blocks.0", "RS wait root", "RS done root", "AR issue root", "AR wait blocks.3",
      "AR done blocks.3", "AR wait blocks.2", "AR done blocks.2", "AR wait blocks.1",
      "AR done blocks.1", "AR wait blocks.0", "AR done blocks.0", "AR wait root", "AR done root"};
  EXPECT_EQ(joined(run.schedule), joined(expected));
}

HP_DIST_TEST(Schedule, OverlapLeavesNumbersBitwiseUnchanged, 4) {
  const Run overlapped = traced_step(/*implicit_prefetch=*/true);
  const Run serial = traced_step(/*implicit_prefetch=*/false);
  ASSERT_EQ(overlapped.grads.size(), serial.grads.size());
  for (const auto& [name, grad] : overlapped.grads) {
    EXPECT_TRUE(torch::equal(grad, serial.grads.at(name))) << name;
  }
  // Without prefetch every all-gather is issued right before it is waited for.
  for (size_t i = 0; i + 1 < serial.schedule.size(); ++i) {
    if (serial.schedule[i].rfind("AG issue", 0) == 0) {
      EXPECT_EQ(serial.schedule[i + 1].substr(0, 7), "AG wait") << joined(serial.schedule);
    }
  }
}

}  // namespace
}  // namespace hp
