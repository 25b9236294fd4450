// Training-loop features of fully_shard against the single-process reference:
// gradient accumulation without sync (L2-01), frozen parameters (L2-02), CPU offload.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_internals.h"
#include "fsdp_test_util.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

struct ShardedMlp {
  Mlp reference{nullptr};
  Sharded<Mlp> model{nullptr};
  std::optional<FSDPModule> root;
  testing::ShardedParts parts;

  // `prepare` runs on both models before sharding (e.g. to freeze parameters).
  explicit ShardedMlp(FullyShardOptions options = {},
                      const std::function<void(torch::nn::Module&)>& prepare = {}) {
    torch::manual_seed(42);
    reference = Mlp(5, 8, 9, 3, 3);
    torch::manual_seed(42);
    model = Sharded<Mlp>(5, 8, 9, 3, 3);
    if (prepare) {
      prepare(*reference);
      prepare(*model);
    }
    parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
    root = parts.back().second;
  }

  // This rank's loss on its share of batch `seed`; the reference runs the whole batch
  // with the loss scaled by `reference_scale`.
  at::Tensor loss(int64_t seed, double reference_scale = 1.0) {
    torch::manual_seed(seed);
    at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
    (torch::mse_loss(reference(x), y) * reference_scale).backward();
    auto world = testing::world();
    return torch::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                           testing::local_batch(y, world->rank(), world->size()));
  }

  // `steps` AdamW steps (lr 1e-2) of both models in lockstep, step i on batch i:
  // `after_backward` sees the gradients, `after_step` the updated parameters.
  void train(int steps, const std::function<void()>& after_backward,
             const std::function<void()>& after_step = {}) {
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      loss(step).backward();
      if (after_backward) after_backward();
      opt.step();
      ref_opt.step();
      if (after_step) after_step();
    }
  }
};

// L2-01: N micro-steps with gradient sync off, then one with it on, equal one large
// batch; no sharded gradient exists before the synchronising backward.
HP_DIST_TEST(FullyShardTraining, L2_01_GradientAccumulation, 2) {
  ShardedMlp f;
  const int micro_steps = 4;
  f.root->set_requires_gradient_sync(false);
  for (int step = 0; step < micro_steps; ++step) {
    if (step == micro_steps - 1) f.root->set_requires_gradient_sync(true);
    // The large-batch loss is the mean over micro-batches.
    (f.loss(step, 1.0 / micro_steps) / micro_steps).backward();
    if (step < micro_steps - 1) {
      for (const auto& p : f.model->parameters()) {
        ASSERT_FALSE(p.grad().defined()) << "a gradient was reduced while sync was off";
      }
    }
  }
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "accumulated grad");
}

// L2-02: frozen parameters get no gradient, keep their data, and are never reduced;
// the others match the reference.
HP_DIST_TEST(FullyShardTraining, L2_02_FrozenParamsMixedTraining, 2) {
  auto freeze = [](torch::nn::Module& m) {
    for (auto& item : m.named_parameters()) {
      if (item.key().rfind("blocks.1.", 0) == 0 || item.key() == "input.weight") {
        item.value().set_requires_grad(false);
      }
    }
  };
  ShardedMlp f({}, freeze);
  const auto before = testing::full_params(f.parts);
  f.train(2, [&] {
    auto grads = testing::full_grads(f.parts);
    testing::expect_all_close(grads, testing::reference_grads(*f.reference), 1e-5, "grad");
    EXPECT_FALSE(grads["blocks.1.fc1.weight"].defined());
    EXPECT_FALSE(grads["input.weight"].defined());
  });
  const auto after = testing::full_params(f.parts);
  EXPECT_TRUE(torch::equal(after.at("blocks.1.fc2.bias"), before.at("blocks.1.fc2.bias")));
  EXPECT_TRUE(torch::equal(after.at("input.weight"), before.at("input.weight")));
  testing::expect_all_close(after, testing::reference_params(*f.reference), 1e-5, "param");
  // Block 1 is wholly frozen: its reduction never ran.
  const auto stats = testing::reduce_buffer_stats(f.parts[1].second);
  EXPECT_EQ(stats.freed_owned + stats.kept_aliased, 0);
  const auto block0 = testing::reduce_buffer_stats(f.parts[0].second);
  EXPECT_EQ(block0.freed_owned + block0.kept_aliased, 2 * 4) << "4 params, 2 steps";
}

// offload_policy on a CPU-only host: shards, gradients and so optimizer state live in
// host memory (pinning needs CUDA, so nothing is pinned), and training is unchanged.
HP_DIST_TEST(FullyShardTraining, OffloadKeepsShardsOnHostAndTrainsTheSame, 2) {
  FullyShardOptions options;
  options.offload_policy.offload = true;
  options.offload_policy.pin_memory = true;
  ShardedMlp f(options);
  f.train(2, [&] {
    for (const auto& p : f.model->parameters()) {
      EXPECT_TRUE(p.device().is_cpu());
      EXPECT_FALSE(p.is_pinned());
      EXPECT_TRUE(p.grad().device().is_cpu());
    }
    testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                              1e-5, "grad");
  });
  testing::expect_all_close(testing::full_params(f.parts), testing::reference_params(*f.reference),
                            1e-5, "param");
}

// Clearing gradients the usual way (the optimizer's zero_grad, which sets them to none)
// works with every gradient path: fp32 main grads, partial HSDP grads, and reductions
// left in flight by set_is_last_backward(false) (FSDPModule::zero_grad finishes them).
void expect_grads_match(ShardedMlp& f) {
  testing::expect_all_close(testing::full_grads(f.parts), testing::reference_grads(*f.reference),
                            1e-5, "grad");
}

// A backward on batch 0 with `leave_unfinished(true)`, `clear_grads`, then a backward on
// batch 1 with `leave_unfinished(false)`: the gradients must be batch 1's alone.
void expect_cleared_between_backwards(ShardedMlp& f,
                                      const std::function<void(bool)>& leave_unfinished,
                                      const std::function<void()>& clear_grads) {
  leave_unfinished(true);
  f.loss(0).backward();
  clear_grads();
  f.reference->zero_grad();
  leave_unfinished(false);
  f.loss(1).backward();
  expect_grads_match(f);
}

HP_DIST_TEST(FullyShardTraining, OptimizerZeroGradResetsMainGrad, 2) {
  FullyShardOptions options;
  options.mp_policy.apply_grad_on_fp32_main_grad = true;
  ShardedMlp f(options);
  f.train(3, [&] { expect_grads_match(f); });
}

HP_DIST_TEST(FullyShardTraining, OptimizerZeroGradAfterPartialGrads, 4) {
  FullyShardOptions options;
  options.mesh = DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}});
  ShardedMlp f(options);
  torch::optim::AdamW opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
  // Without the all-reduce across replicas the first gradients are partial.
  expect_cleared_between_backwards(
      f, [&](bool partial) { f.root->set_requires_all_reduce(!partial); },
      [&] { opt.zero_grad(); });
}

HP_DIST_TEST(FullyShardTraining, ZeroGradFinishesReductionsInFlight, 2) {
  ShardedMlp f;
  // Not the last backward: its reductions stay in flight.
  expect_cleared_between_backwards(
      f, [&](bool in_flight) { f.root->set_is_last_backward(!in_flight); },
      [&] { f.root->zero_grad(); });
}

// An evaluation forward (no grad) between backward and the optimizer step leaves every
// module sharded, so the step updates all shards and the next forward sees them.
HP_DIST_TEST(FullyShardTraining, EvalForwardBeforeStep, 2) {
  ShardedMlp f;
  f.train(
      2,
      [&] {
        {
          torch::NoGradGuard no_grad;
          f.model(torch::randn({2, 5}));
        }
        for (const auto& part : f.parts) EXPECT_FALSE(part.second.is_unsharded());
      },
      [&] {
        testing::expect_all_close(testing::full_params(f.parts),
                                  testing::reference_params(*f.reference), 1e-5, "param");
      });
}

// --- parameters unused on some ranks ------------------------------------------------

// A branch one rank takes and the other does not (an expert without tokens): the rank
// without it reduces zeros, so both ranks issue the same collectives, and the averaged
// gradient is the reference's (the branch's gradient from the rank that took it).
struct TwoBranchesImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool take_b = true;
  TwoBranchesImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return take_b ? b(a(x)) : a(x); }
};
TORCH_MODULE(TwoBranches);

void expect_unused_branch_reduces_to_the_reference(bool comm_fusion) {
  auto world = testing::world();
  const int64_t rank = world->rank();
  torch::manual_seed(3);
  TwoBranches reference;
  torch::manual_seed(3);
  Sharded<TwoBranches> model;
  FullyShardOptions options;
  options.comm_fusion = comm_fusion;
  FSDPModule module = fully_shard(model, options);
  const at::Tensor x = torch::randn({2, 6, 4});
  // Rank 1 leaves b out; the reference averages the two ranks' losses.
  at::Tensor total = at::zeros({});
  for (int64_t r = 0; r < 2; ++r) {
    reference->take_b = r == 0;
    total = total + reference->forward(x[r]).square().mean() / 2;
  }
  total.backward();
  model->take_b = rank == 0;
  model(x[rank]).square().mean().backward();
  for (const auto& item : reference->named_parameters()) {
    EXPECT_TRUE(torch::allclose(module.full_grad(item.key()), item.value().grad(), 0, 1e-6))
        << item.key();
  }
}

HP_DIST_TEST(FullyShardTraining, ABranchUnusedOnOneRankReducesZerosThere, 2) {
  expect_unused_branch_reduces_to_the_reference(/*comm_fusion=*/false);
}

HP_DIST_TEST(FullyShardTraining, ABranchUnusedOnOneRankReducesZerosThereWithCommFusion, 2) {
  expect_unused_branch_reduces_to_the_reference(/*comm_fusion=*/true);
}

}  // namespace
}  // namespace hp
