// The fused optimizers against torch::optim (within rounding), against PyTorch's fused
// kernels called from Python (bit for bit), and on fully_shard-ed parameters: per
// parameter and comm_fusion, FSDP and HSDP, offloaded shards, a sharded checkpoint round
// trip.
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../checkpoint/checkpoint_test_util.h"
#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/fused_optimizers.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "models/mlp.h"
#include "shared_dir.h"

namespace hp {
namespace {

constexpr int kSteps = 10;

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// Parameters of several shapes (one without a gradient: skipped) and kSteps gradients each.
struct Problem {
  std::vector<at::Tensor> initial;
  std::vector<std::vector<at::Tensor>> grads;  // [step][parameter], undefined: none
};

Problem make_problem() {
  torch::manual_seed(3);
  Problem problem;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{7, 5}, {5}, {3, 4, 2}, {6}}) {
    problem.initial.push_back(torch::randn(shape));
  }
  for (int step = 0; step < kSteps; ++step) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < problem.initial.size(); ++i) {
      grads.push_back(i == 3 ? at::Tensor() : torch::randn(problem.initial[i].sizes()));
    }
    problem.grads.push_back(std::move(grads));
  }
  return problem;
}

std::vector<at::Tensor> run(const Problem& problem, const MakeOptimizer& make) {
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : problem.initial) params.push_back(p.clone().requires_grad_(true));
  const std::unique_ptr<torch::optim::Optimizer> optimizer = make(params);
  for (const auto& grads : problem.grads) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
    optimizer->step();
  }
  return params;
}

template <typename Optimizer, typename Options>
MakeOptimizer maker(Options options) {
  return [options](std::vector<at::Tensor> params) {
    return std::make_unique<Optimizer>(std::move(params), options);
  };
}

struct Case {
  std::string name;
  MakeOptimizer fused, reference;
};

std::vector<Case> cases() {
  using namespace torch::optim;
  const AdamWOptions adamw = AdamWOptions(1e-2).weight_decay(0.1).betas({0.8, 0.95});
  const AdamOptions adam = AdamOptions(1e-2).weight_decay(0.05);
  const SGDOptions sgd = SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(0.01);
  return {
      {"adamw", maker<FusedAdamW>(adamw), maker<AdamW>(adamw)},
      {"adamw amsgrad", maker<FusedAdamW>(AdamWOptions(adamw).amsgrad(true)),
       maker<AdamW>(AdamWOptions(adamw).amsgrad(true))},
      {"adam", maker<FusedAdam>(adam), maker<Adam>(adam)},
      {"adam amsgrad", maker<FusedAdam>(AdamOptions(adam).amsgrad(true)),
       maker<Adam>(AdamOptions(adam).amsgrad(true))},
      {"sgd momentum", maker<FusedSGD>(sgd), maker<SGD>(sgd)},
      {"sgd nesterov", maker<FusedSGD>(SGDOptions(sgd).dampening(0).nesterov(true)),
       maker<SGD>(SGDOptions(sgd).dampening(0).nesterov(true))},
      {"sgd plain", maker<FusedSGD>(SGDOptions(0.1)), maker<SGD>(SGDOptions(0.1))},
  };
}

TEST(FusedOptimizers, StepAsTorchOptimWithinRounding) {
  const Problem problem = make_problem();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<at::Tensor> fused = run(problem, c.fused);
    const std::vector<at::Tensor> reference = run(problem, c.reference);
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_LE(testing::max_abs_diff(fused[i], reference[i]), 1e-6) << "parameter " << i;
      EXPECT_FALSE(torch::equal(fused[i], problem.initial[i]) && i != 3) << "did not move";
    }
    EXPECT_TRUE(torch::equal(fused[3], problem.initial[3])) << "no gradient: no step";
  }
}

// torch.optim's fused AdamW, Adam and SGD run the same kernels: the same bits, states
// included (Python's step counts are fp32 tensors too).
TEST(FusedOptimizers, MatchPyTorchsFusedOptimizersBitwise) {
  const std::string dir = testing::shared_dir("hp_fused_python");
  Problem problem = make_problem();
  for (auto& grads : problem.grads) grads.pop_back();  // Python's loop sets every gradient
  problem.initial.pop_back();
  StateDict written;
  for (size_t i = 0; i < problem.initial.size(); ++i) {
    written.insert("initial." + std::to_string(i), problem.initial[i]);
    for (int step = 0; step < kSteps; ++step) {
      written.insert("grad." + std::to_string(step) + "." + std::to_string(i),
                     problem.grads[step][i]);
    }
  }
  write_state_dict_file(written, dir + "/problem.pt");
  const bool ran = testing::run_python(dir, R"(
problem = torch.load(sys.argv[0].replace('check.py', 'problem.pt'))
n = sum(1 for name in problem if name.startswith('initial.'))
steps = sum(1 for name in problem if name.startswith('grad.')) // n
makers = {
    'adamw': lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), fused=True),
    'adam': lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, fused=True),
    'sgd': lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True),
}
out = {}
for name, make in makers.items():
    params = [problem[f'initial.{i}'].clone().requires_grad_(True) for i in range(n)]
    opt = make(params)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = problem[f'grad.{step}.{i}'].clone()
        opt.step()
    for i, p in enumerate(params):
        out[f'{name}.{i}'] = p.detach()
torch.save(out, sys.argv[0].replace('check.py', 'stepped.pt'))
)");
  ASSERT_TRUE(ran) << "python3 has no torch";
  const StateDict python = read_state_dict_file(dir + "/stepped.pt");
  using namespace torch::optim;
  const std::vector<std::pair<std::string, MakeOptimizer>> ours = {
      {"adamw", maker<FusedAdamW>(AdamWOptions(1e-2).weight_decay(0.1).betas({0.8, 0.95}))},
      {"adam", maker<FusedAdam>(AdamOptions(1e-2).weight_decay(0.05))},
      {"sgd", maker<FusedSGD>(SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(0.01))}};
  for (const auto& [name, make] : ours) {
    const std::vector<at::Tensor> mine = run(problem, make);
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_TRUE(torch::equal(mine[i], python[name + "." + std::to_string(i)]))
          << name << " parameter " << i;
    }
  }
}

TEST(FusedOptimizers, AGradientTheKernelCannotTakeIsNamed) {
  at::Tensor param = torch::zeros({4, 3}).requires_grad_(true);
  param.mutable_grad() = torch::ones({4, 3}, torch::kDouble);
  FusedAdamW optimizer({param});
  try {
    optimizer.step();
    FAIL() << "a double gradient of a float parameter was taken";
  } catch (const c10::ValueError& error) {
    const std::string what = error.what_without_backtrace();
    EXPECT_NE(what.find("FusedAdamW: parameter 0 of group 0 ([4, 3] Float on cpu) has a "
                        "gradient of Double on cpu"),
              std::string::npos)
        << what;
  }
}

// A fully_shard-ed Mlp trained kSteps with `make` on this rank's share of fixed batches;
// returns its whole parameters.
std::map<std::string, at::Tensor> train_sharded(const FullyShardOptions& options,
                                                const MakeOptimizer& make,
                                                const std::string& checkpoint = "") {
  auto world = testing::world();
  torch::manual_seed(11);
  Sharded<models::Mlp> model(6, 10, 12, 4, 2);
  const testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  std::unique_ptr<torch::optim::Optimizer> optimizer = make(model->parameters());
  for (int step = 0; step < kSteps; ++step) {
    if (step == kSteps / 2 && !checkpoint.empty()) {  // a resumed run from here on
      save_sharded_checkpoint(checkpoint, *model, optimizer.get());
      optimizer = make(model->parameters());
      load_sharded_checkpoint(checkpoint, *model, optimizer.get());
    }
    torch::manual_seed(100 + step);
    const at::Tensor x = torch::randn({8, 6}), y = torch::randn({8, 4});
    optimizer->zero_grad();
    testing::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                      testing::local_batch(y, world->rank(), world->size()))
        .backward();
    optimizer->step();
  }
  return testing::full_params(parts);
}

HP_DIST_TEST(FusedOptimizers, StepFullyShardedParametersAsTorchOptim, 2, 4) {
  auto world = testing::world();
  using namespace torch::optim;
  const AdamWOptions adamw = AdamWOptions(1e-2).weight_decay(0.1);
  const std::string dir = testing::shared_dir("hp_fused_sharded");
  for (const bool comm_fusion : {false, true}) {
    for (const bool offload : {false, true}) {
      SCOPED_TRACE(std::string(comm_fusion ? "comm_fusion" : "per parameter") +
                   (offload ? ", offloaded" : ""));
      FullyShardOptions options;
      options.comm_fusion = comm_fusion;
      options.offload_policy.offload = offload;
      if (world->size() == 4)
        options.mesh = DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
      const auto reference = train_sharded(options, maker<AdamW>(adamw));
      const auto fused = train_sharded(options, maker<FusedAdamW>(adamw));
      EXPECT_LE(testing::max_abs_diff(fused, reference), 1e-6);
      // Saved and loaded halfway (the state as torch::optim's): the same bits as straight.
      const std::string checkpoint =
          checkpoint_dir_for_step(dir, (comm_fusion ? 2 : 0) + (offload ? 1 : 0) + 1);
      const auto resumed = train_sharded(options, maker<FusedAdamW>(adamw), checkpoint);
      for (const auto& [name, value] : fused) {
        EXPECT_TRUE(torch::equal(resumed.at(name), value)) << name;
      }
    }
  }
}

}  // namespace
}  // namespace hp
