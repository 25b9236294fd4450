// fully_shard on one CUDA rank against the plain model on the same GPU, on the global
// batch. (Against a CPU reference, AdamW turns the CPU's and the GPU's different
// summation orders, an ulp on gradients near zero, into parameter differences of about
// 6e-5 after two steps; the reference on the same device isolates what fully_shard does.)
// Skipped where this process sees no CUDA device; scripts/gpu_check.sh runs them on a GPU
// machine, once with one-rank groups skipping communication and once with them
// communicating (HP_ONE_RANK_GROUPS_COMMUNICATE=1: the lanes, coalesced and fused
// collectives, the all-reduce). The module is built on the CPU: fully_shard moves it to
// the World's device, as FSDP2 moves module states to the mesh's device.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/trace.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

std::map<std::string, at::Tensor> on_cpu(const std::map<std::string, at::Tensor>& tensors) {
  std::map<std::string, at::Tensor> moved;
  for (const auto& [name, tensor] : tensors) {
    moved[name] = tensor.defined() ? tensor.to(at::kCPU) : tensor;
  }
  return moved;
}

struct Differences {
  double loss = 0, grad = 0, param = 0;
};

void expect_within(const Differences& d, double tolerance) {
  EXPECT_LE(d.loss, tolerance) << "loss";
  EXPECT_LE(d.grad, tolerance) << "gradients";
  EXPECT_LE(d.param, tolerance) << "parameters";
}

// Two AdamW steps of the model fully_shard-ed with `options` and of the plain reference,
// both on the GPU, on the same batches: the largest differences of the losses, of the
// gradients and of the parameters after each step. Each step accumulates the gradients
// of `backwards` forward-backward passes.
Differences differences(const FullyShardOptions& options, int backwards = 1) {
  const c10::Device device = testing::world()->device();
  EXPECT_TRUE(device.is_cuda()) << device;
  auto [reference, model] = testing::build_from_seed<Mlp>(42, 5, 64, 96, 3, 3);
  reference->to(device);
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  const c10::Device shard_device = options.offload_policy.offload ? c10::Device(at::kCPU) : device;
  for (const auto& p : model->parameters()) EXPECT_EQ(p.device(), shard_device);

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(7);
  Differences largest;
  for (int step = 0; step < 2; ++step) {
    const at::Tensor x = torch::randn({12, 5}).to(device), y = torch::randn({12, 3}).to(device);
    ref_opt.zero_grad();
    opt.zero_grad();
    for (int pass = 0; pass < backwards; ++pass) {
      const at::Tensor ref_loss = torch::mse_loss(reference->forward(x * (pass + 1)), y);
      ref_loss.backward();
      const at::Tensor loss = torch::mse_loss(model(x * (pass + 1)), y);
      EXPECT_EQ(loss.device(), device);
      loss.backward();
      largest.loss =
          std::max(largest.loss, std::abs(loss.item<double>() - ref_loss.item<double>()));
    }
    largest.grad =
        std::max(largest.grad, testing::max_abs_diff(on_cpu(testing::full_grads(parts)),
                                                     on_cpu(testing::reference_grads(*reference))));
    if (options.offload_policy.offload) {
      // Copied to pinned host memory without blocking the host (synchronized at the end of
      // backward).
      for (const auto& p : model->parameters()) {
        if (p.grad().defined()) EXPECT_TRUE(p.grad().is_pinned());
      }
    }
    ref_opt.step();
    opt.step();
    largest.param = std::max(largest.param,
                             testing::max_abs_diff(on_cpu(testing::full_params(parts)),
                                                   on_cpu(testing::reference_params(*reference))));
  }
  return largest;
}

HP_DIST_TEST(Cuda, FullyShardOnOneGpuMatchesThePlainModel, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  expect_within(differences({}), 1e-5);
  FullyShardOptions fused;
  fused.comm_fusion = true;
  expect_within(differences(fused), 1e-5);
}

// Shard(1) for matrices and Replicate() for vectors (all-reduced), parameters kept
// unsharded after forward, and gradients of two backwards accumulated.
HP_DIST_TEST(Cuda, PlacementsAndSchedulesOnOneGpuMatchThePlainModel, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  FullyShardOptions placed;
  placed.shard_placement_fn = [](const std::string&, const at::Tensor& param) {
    return param.dim() == 2 ? Placement::shard(1) : Placement::replicate();
  };
  expect_within(differences(placed), 1e-5);
  FullyShardOptions kept;
  kept.reshard_after_forward = false;
  expect_within(differences(kept, /*backwards=*/2), 1e-5);
}

// Pinned host shards and gradients; the all-gather input and the reduced gradient cross
// the bus every step.
HP_DIST_TEST(Cuda, OffloadedShardsRoundTripThroughTheGpu, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  FullyShardOptions offloaded;
  offloaded.offload_policy.offload = true;
  offloaded.offload_policy.pin_memory = true;
  expect_within(differences(offloaded), 1e-5);
  // The second backward adds to the host gradient the first one copied asynchronously.
  expect_within(differences(offloaded, /*backwards=*/2), 1e-5);
}

// On a GPU the trace is timed by CUDA events: every span is well formed on the device's
// clock (a begin before its end, a collective's issue before its done), in the order the
// host recorded them.
HP_DIST_TEST(Cuda, TraceTimesSpansWithDeviceEvents, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const c10::Device device = testing::world()->device();
  auto built = testing::build_from_seed<Mlp>(42, 5, 64, 96, 3, 3);
  auto& model = built.model;
  testing::ShardedParts parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.");
  const at::Tensor x = torch::randn({12, 5}).to(device), y = torch::randn({12, 3}).to(device);
  torch::mse_loss(model(x), y).backward();  // warm-up: allocations and the prefetch order
  trace::start(device);
  torch::mse_loss(model(x), y).backward();
  const std::vector<trace::Event> events = trace::stop();
  std::map<std::string, std::vector<double>> open;  // op + module -> begin times
  int spans = 0;
  for (const trace::Event& e : events) {
    EXPECT_TRUE(std::isfinite(e.time_us) && e.time_us >= 0) << trace::describe(e);
    const std::string key = e.op + " " + e.module;
    if (e.kind == trace::Kind::kBegin || e.kind == trace::Kind::kIssue) {
      open[key].push_back(e.time_us);
    } else if (e.kind == trace::Kind::kEnd || e.kind == trace::Kind::kWaitEnd) {
      ASSERT_FALSE(open[key].empty()) << trace::describe(e);
      EXPECT_LE(open[key].front(), e.time_us) << trace::describe(e);
      open[key].erase(open[key].begin());
      ++spans;
    }
  }
  // Forward and backward of the root and the three blocks at least.
  EXPECT_GE(spans, 8);
}

}  // namespace
}  // namespace hp
