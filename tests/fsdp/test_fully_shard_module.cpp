// The fully_shard module interface: test plan L1-01 .. L1-05 and L1-09.
#include <torch/torch.h>

#include "comm_handle_internals.h"
#include "distributed_test.h"
#include "fsdp_internals.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

// A sharded model (3 blocks + root) next to its single-process reference.
struct Fixture {
  Mlp reference{nullptr};
  Sharded<Mlp> model{nullptr};
  std::vector<FSDPModule> blocks;
  std::optional<FSDPModule> root;
  testing::ShardedParts parts;

  explicit Fixture(FullyShardOptions options = {}) {
    torch::manual_seed(42);
    reference = Mlp(5, 8, 9, 3, 3);
    torch::manual_seed(42);
    model = Sharded<Mlp>(5, 8, 9, 3, 3);
    for (size_t i = 0; i < model->blocks.size(); ++i) {
      blocks.push_back(fully_shard(model->blocks[i], options));
      parts.emplace_back("blocks." + std::to_string(i) + ".", blocks.back());
    }
    root = fully_shard(model, options);
    parts.emplace_back("", *root);
  }

  // Loss of this rank's share of a global batch drawn from `seed`; the reference, when
  // asked, runs the global batch.
  at::Tensor loss(int64_t seed, bool reference_too = false) {
    torch::manual_seed(seed);
    at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
    if (reference_too) torch::mse_loss(reference(x), y).backward();
    auto world = testing::world();
    return torch::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                           testing::local_batch(y, world->rank(), world->size()));
  }
};

int64_t numel_of(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

// --- L1-01 -----------------------------------------------------------------------------

HP_DIST_TEST(FullyShardModule, L1_01_DynamicReshardControl, 2) {
  Fixture f;
  torch::nn::Module& block = *f.model->blocks[1].ptr();
  const int64_t full = numel_of(*f.reference->blocks[1].ptr());
  const int64_t shard = numel_of(block);
  ASSERT_LT(shard, full);

  f.loss(1);
  EXPECT_EQ(numel_of(block), shard) << "blocks reshard after forward by default";

  f.blocks[1].set_reshard_after_forward(false);
  at::Tensor loss = f.loss(2);
  EXPECT_EQ(numel_of(block), full) << "set_reshard_after_forward(false) keeps it unsharded";
  loss.backward();
  EXPECT_EQ(numel_of(block), shard) << "backward reshards (reshard_after_backward)";

  f.blocks[1].set_reshard_after_forward(true);
  f.loss(3);
  EXPECT_EQ(numel_of(block), shard);

  f.blocks[1].set_reshard_after_backward(false);
  f.loss(4).backward();
  EXPECT_EQ(numel_of(block), full) << "set_reshard_after_backward(false) keeps it unsharded";
  f.blocks[1].set_reshard_after_backward(true);
  f.blocks[1].reshard();
  EXPECT_EQ(numel_of(block), shard);
  f.loss(5).backward();
  EXPECT_EQ(numel_of(block), shard);

  // Switching never changed the numbers: gradients of the last backward are right.
  f.root->zero_grad();
  f.reference->zero_grad();
  f.loss(6, /*reference_too=*/true).backward();
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "grad");
}

// reshard_after_forward = 2 on a shard group of 4: after forward each block keeps half of
// each parameter per node-like pair of ranks; numbers are unchanged.
HP_DIST_TEST(FullyShardModule, L1_01_ReshardAfterForwardToSmallerGroup, 4) {
  FullyShardOptions options;
  options.reshard_after_forward = int64_t{2};
  Fixture f(options);
  // Each rank keeps its parameters over the 2 consecutive shard ranks around it.
  const int64_t rank = testing::world()->rank();
  const std::vector<int64_t> pair = {rank / 2 * 2, rank / 2 * 2 + 1};
  for (const auto& block : f.blocks) EXPECT_EQ(testing::post_forward_ranks(block), pair);
  for (int step = 0; step < 2; ++step) {
    f.root->zero_grad();
    f.reference->zero_grad();
    at::Tensor loss = f.loss(10 + step, /*reference_too=*/true);
    EXPECT_EQ(numel_of(*f.model->blocks[0].ptr()), numel_of(*f.model->blocks[1].ptr()))
        << "after forward the variables hold this rank's shard again";
    loss.backward();
    testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                              1e-5, "grad");
  }
}

// --- L1-02 -----------------------------------------------------------------------------

// Whether `tensor` is equal on the two ranks of `group` (within atol).
bool same_across(const Group& group, const at::Tensor& tensor, double atol) {
  at::Tensor all = torch::empty({group.size() * tensor.numel()});
  all_gather(all, tensor.detach().reshape(-1).to(at::kFloat).contiguous(), group).wait();
  auto parts = all.view({group.size(), -1});
  return (parts[0] - parts[1]).abs().max().item<double>() <= atol;
}

HP_DIST_TEST(FullyShardModule, L1_02_SetRequiresAllReduce, 4) {
  FullyShardOptions options;
  DeviceMesh mesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}});
  options.mesh = mesh;
  Fixture f(options);
  const Group& replicas = *mesh.group("dp_replicate");
  auto grads_agree = [&](const std::string& prefix) {
    bool all_same = true;
    for (const auto& [name, grad] : testing::full_grads(f.parts)) {
      if (name.rfind(prefix, 0) == 0) all_same = all_same && same_across(replicas, grad, 1e-6);
    }
    return all_same;
  };

  f.root->set_requires_all_reduce(false);
  f.loss(1).backward();
  EXPECT_FALSE(grads_agree("blocks.")) << "without all-reduce, replica groups differ";
  EXPECT_FALSE(grads_agree("head."));

  f.root->zero_grad();
  f.root->set_requires_all_reduce(true);
  f.reference->zero_grad();
  f.loss(2, /*reference_too=*/true).backward();
  EXPECT_TRUE(grads_agree("")) << "with all-reduce, replica groups agree within 1e-6";
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "grad");

  // recurse=false: only the root's own parameters skip the all-reduce.
  f.root->zero_grad();
  f.root->set_requires_all_reduce(false, /*recurse=*/false);
  f.loss(3).backward();
  EXPECT_TRUE(grads_agree("blocks."));
  EXPECT_FALSE(grads_agree("head."));

  // Accumulation: a backward without all-reduce, then one with it, equals the
  // reference's two accumulated backwards.
  f.root->zero_grad();
  f.reference->zero_grad();
  f.root->set_requires_all_reduce(false);
  f.loss(4, /*reference_too=*/true).backward();
  f.root->set_requires_all_reduce(true);
  f.loss(5, /*reference_too=*/true).backward();
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "accumulated grad");
}

// --- L1-03 -----------------------------------------------------------------------------

HP_DIST_TEST(FullyShardModule, L1_03_SetReduceOpType, 2) {
  Fixture f;
  const double world = 2;
  torch::optim::AdamW opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(f.reference->parameters(), torch::optim::AdamWOptions(1e-2));
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kSum}) {
    SCOPED_TRACE(to_string(op));
    opt.zero_grad();
    ref_opt.zero_grad();
    f.root->set_reduce_op_type(op);
    f.loss(op == ReduceOp::kAvg ? 1 : 2, /*reference_too=*/true).backward();
    auto expected = testing::reference_grads(*f.reference);
    if (op == ReduceOp::kSum) {
      for (auto& [name, grad] : expected) grad = grad * world;
      for (auto& p : f.reference->parameters()) p.mutable_grad().mul_(world);
    }
    testing::expect_all_close(testing::full_grads(f.parts), expected, 1e-5, "grad");
    // The optimizer sees exactly these gradients: its state evolves like the reference's.
    opt.step();
    ref_opt.step();
    testing::expect_all_close(testing::full_params(f.parts),
                              testing::reference_params(*f.reference), 1e-5, "param");
  }
  // A custom divide factor replaces the op's division: sum over 2 ranks, divided by 8.
  f.root->set_gradient_divide_factor(8.0);
  f.root->zero_grad();
  f.reference->zero_grad();
  f.loss(3, /*reference_too=*/true).backward();
  auto expected = testing::reference_grads(*f.reference);
  for (auto& [name, grad] : expected) grad = grad * world / 8.0;
  testing::expect_all_close(testing::full_grads(f.parts), expected, 1e-5, "grad / 8");
}

// --- L1-04 -----------------------------------------------------------------------------

HP_DIST_TEST(FullyShardModule, L1_04_ZeroGrad, 2) {
  Fixture f;
  for (int step = 0; step < 3; ++step) f.loss(step, /*reference_too=*/true).backward();
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "accumulated grad");
  std::vector<at::Tensor> snapshot;
  for (const auto& p : f.model->parameters()) snapshot.push_back(p.detach().clone());

  f.root->zero_grad();
  auto params = f.model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_FALSE(params[i].grad().defined()) << "param " << i << " still has a grad";
    EXPECT_TRUE(torch::equal(params[i].detach(), snapshot[i])) << "zero_grad changed data";
  }
  f.reference->zero_grad();
  f.loss(9, /*reference_too=*/true).backward();
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "fresh grad");
}

// --- L1-05 -----------------------------------------------------------------------------

HP_DIST_TEST(FullyShardModule, L1_05_ManualReshardUnshardLifecycle, 2) {
  Fixture f;
  FSDPModule& block = f.blocks[0];
  torch::nn::Module& module = *f.model->blocks[0].ptr();
  const int64_t full = numel_of(*f.reference->blocks[0].ptr());
  const int64_t shard = numel_of(module);

  block.unshard();
  block.unshard();  // idempotent
  EXPECT_EQ(numel_of(module), full);
  EXPECT_TRUE(block.is_unsharded());
  auto reference_params = f.reference->blocks[0]->named_parameters();
  for (const auto& item : module.named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value().detach(), reference_params[item.key()].detach()))
        << item.key() << " unsharded differs from the full parameter";
  }
  block.reshard();
  block.reshard();  // idempotent
  EXPECT_EQ(numel_of(module), shard);
  EXPECT_FALSE(block.is_unsharded());

  CommHandle handle = block.unshard(/*async_op=*/true);
  EXPECT_TRUE(handle.pending());
  EXPECT_TRUE(testing::has_work(handle)) << "two shard ranks: real all-gathers are in flight";
  EXPECT_EQ(numel_of(module), shard) << "an async unshard installs nothing before wait()";
  handle.wait();
  EXPECT_EQ(numel_of(module), full);
  EXPECT_TRUE(block.is_unsharded());
  handle.wait();  // a second wait does nothing
  block.reshard();
  EXPECT_EQ(numel_of(module), shard);

  // reshard() while an async unshard is pending: the collective completes, nothing is
  // installed, and the module stays usable.
  CommHandle abandoned = block.unshard(/*async_op=*/true);
  block.reshard();
  EXPECT_EQ(numel_of(module), shard);
  abandoned.wait();
  EXPECT_EQ(numel_of(module), shard);
  f.loss(1, /*reference_too=*/true).backward();
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "grad");
}

// --- L1-09 -----------------------------------------------------------------------------

HP_DIST_TEST(FullyShardModule, L1_09_FullyShardListInput, 2) {
  torch::manual_seed(42);
  Mlp reference(5, 8, 9, 3, 3);
  torch::manual_seed(42);
  Sharded<Mlp> model(5, 8, 9, 3, 3);
  // Blocks 0 and 1 share one state; block 2 has its own.
  std::vector<FSDPModule> pair = fully_shard({model->blocks[0], model->blocks[1]});
  ASSERT_EQ(pair.size(), 2u);
  EXPECT_TRUE(testing::same_state(pair[0], pair[1])) << "one state for the list";
  FSDPModule third = fully_shard(model->blocks[2]);
  FSDPModule root = fully_shard(model);
  testing::ShardedParts parts = {{"blocks.", pair[0]}, {"blocks.2.", third}, {"", root}};

  // The list's state names parameters by position in the list.
  std::vector<std::string> names;
  for (const auto& info : pair[1].sharded_params()) names.push_back(info.name);
  EXPECT_EQ(names.front(), "0.fc1.weight");

  // Both handles drive the same parameters; other modules are untouched.
  pair[1].unshard();
  EXPECT_TRUE(pair[0].is_unsharded());
  EXPECT_FALSE(third.is_unsharded());
  pair[0].reshard();
  EXPECT_FALSE(pair[1].is_unsharded());

  third.set_requires_gradient_sync(false);  // independent of the pair

  torch::manual_seed(3);
  at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
  torch::mse_loss(reference(x), y).backward();
  auto world = testing::world();
  torch::mse_loss(model(testing::local_batch(x, world->rank(), 2)),
                  testing::local_batch(y, world->rank(), 2))
      .backward();
  auto grads = testing::full_grads(parts);
  auto expected = testing::reference_grads(*reference);
  for (const auto& [name, grad] : grads) {
    if (name.rfind("blocks.2.", 0) == 0) {
      EXPECT_FALSE(grad.defined()) << name << ": sync off keeps block 2's grads unsharded";
      continue;
    }
    ASSERT_TRUE(grad.defined()) << name;
    EXPECT_TRUE(torch::isfinite(grad).all().item<bool>()) << name;
    EXPECT_LE((grad - expected[name]).abs().max().item<double>(), 1e-5) << name;
  }
}

}  // namespace
}  // namespace hp
