// fully_shard on one CUDA rank against the plain model on the same GPU, on the global
// batch. (Against a CPU reference, AdamW turns the CPU's and the GPU's different
// summation orders, an ulp on gradients near zero, into parameter differences of about
// 6e-5 after two steps; the reference on the same device isolates what fully_shard does.)
// Skipped where this process sees no CUDA device; scripts/gpu_check.sh runs them on a GPU
// machine, once with one-rank groups skipping communication and once with them
// communicating (HP_ONE_RANK_GROUPS_COMMUNICATE=1: the lanes, coalesced and fused
// collectives, the all-reduce). The module is built on the CPU: fully_shard moves it to
// the World's device, as FSDP2 moves module states to the mesh's device. The codecs
// (comm_codec.h) quantize on the GPU by tensor operations and on the CPU by a loop; on the
// GPU they must give the CPU's bits, in the collectives and in fully_shard.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/comm_codec.h"
#include "hyperparallel/quantized_collectives.h"
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

// The bits of a tensor (NaNs included), on the CPU, for comparisons that must be exact.
at::Tensor bits_of(const at::Tensor& t) {
  const at::Tensor cpu = t.to(at::kCPU).contiguous();
  return cpu.view(cpu.element_size() == 4 ? at::kInt : at::kByte);
}

// The CPU's quantize-dequantize of `values` as one row, in its shape.
at::Tensor cpu_round_trip(const at::Tensor& values, CommCodec codec, int64_t block) {
  const at::Tensor row = values.to(at::kCPU, at::kFloat).reshape({1, -1});
  return dequantize_blocks(quantize_blocks(row, codec, block), block, at::kFloat)
      .view(values.sizes());
}

// Every case the codecs state: values over many orders of magnitude, a block of zeros,
// one of subnormals, one holding an inf and one a NaN, blocks that do not divide a row.
HP_DIST_TEST(Cuda, BlockCodecsOnTheGpuGiveTheCpusBits, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  torch::manual_seed(0);
  at::Tensor x =
      torch::randn({3, 1000}) * torch::pow(10.0, torch::randint(-6, 6, {3, 1000}).to(at::kFloat));
  x[0].narrow(0, 0, 300).zero_();
  x[1].narrow(0, 0, 300).copy_(torch::randn({300}) * 1e-40);
  x[2][5] = std::numeric_limits<float>::infinity();
  x[2][600] = std::numeric_limits<float>::quiet_NaN();
  const c10::Device device = testing::world()->device();
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    for (int64_t block : {7, 256}) {
      SCOPED_TRACE(to_string(codec) + ", block " + std::to_string(block));
      const QuantizedBlocks on_cpu = quantize_blocks(x, codec, block);
      const QuantizedBlocks on_gpu = quantize_blocks(x.to(device), codec, block);
      ASSERT_TRUE(on_gpu.codes.is_cuda());
      EXPECT_TRUE(torch::equal(bits_of(on_gpu.codes), bits_of(on_cpu.codes)));
      EXPECT_TRUE(torch::equal(bits_of(on_gpu.scales), bits_of(on_cpu.scales)));
      EXPECT_TRUE(torch::equal(bits_of(dequantize_blocks(on_gpu, block, at::kFloat)),
                               bits_of(dequantize_blocks(on_cpu, block, at::kFloat))));
    }
  }
}

// On the one-rank group, communicating, the quantized all-gather and reduce-scatter
// (error feedback's residual too, and coalesced) give what the CPU's quantize-dequantize
// of the same tensors gives, bit for bit; not communicating, nothing is quantized.
HP_DIST_TEST(Cuda, QuantizedCollectivesOnTheGpuMatchTheCpusCodecs, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const Group& group = *testing::world()->world_group();
  const c10::Device device = testing::world()->device();
  const bool quantized = group.communicates();
  constexpr int64_t kBlock = 7;
  torch::manual_seed(1);
  const at::Tensor a = torch::randn({1000}), b = torch::randn({77}) * 1e-3;
  const at::Tensor residual = torch::randn({1000}) * 1e-2;
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    SCOPED_TRACE(to_string(codec));
    const auto expected = [&](const at::Tensor& values) {
      return quantized ? cpu_round_trip(values, codec, kBlock) : values;
    };
    at::Tensor gathered = at::empty({1000}, a.options().device(device));
    quantized_all_gather(gathered, a.to(device), group, codec, kBlock).wait();
    EXPECT_TRUE(torch::equal(bits_of(gathered), bits_of(expected(a))));

    at::Tensor reduced = at::empty({1000}, a.options().device(device));
    at::Tensor kept = residual.to(device, /*non_blocking=*/false, /*copy=*/true);
    quantized_reduce_scatter(reduced, a.to(device), ReduceOp::kAvg, group, codec, kBlock, kept)
        .wait();
    const at::Tensor sent = quantized ? a + residual : a;
    EXPECT_TRUE(torch::equal(bits_of(reduced), bits_of(expected(sent))));
    EXPECT_TRUE(torch::equal(bits_of(kept), bits_of(quantized ? sent - expected(sent) : residual)))
        << "the residual";

    std::vector<at::Tensor> outputs = {at::empty({1000}, a.options().device(device)),
                                       at::empty({77}, a.options().device(device))};
    quantized_reduce_scatter_coalesced(outputs, {a.to(device), b.to(device)}, ReduceOp::kSum, group,
                                       codec, kBlock)
        .wait();
    EXPECT_TRUE(torch::equal(bits_of(outputs[0]), bits_of(expected(a))));
    EXPECT_TRUE(torch::equal(bits_of(outputs[1]), bits_of(expected(b))));
  }
}

// fully_shard with codecs on one GPU rank, communicating: each unsharded weight is its
// shard (the whole parameter) quantized as the CPU would, per parameter and, with
// comm_fusion, the module's shards quantized as one row; each gradient is the one of the
// same model without codecs, quantized as the CPU would. Not communicating, both are
// exact.
HP_DIST_TEST(Cuda, FullyShardWithCodecsOnOneGpuQuantizesAsTheCpu, 1) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const c10::Device device = testing::world()->device();
  const bool quantized = testing::world()->world_group()->communicates();
  constexpr int64_t kBlock = 16;
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(to_string(codec) + (fused ? ", comm_fusion" : ", per parameter"));
      FullyShardOptions options;
      options.comm_fusion = fused;
      options.comm_policy = {.all_gather_codec = codec, .block_size = kBlock};
      auto [reference, model] = testing::build_from_seed<Mlp>(42, 5, 64, 96, 3, 3);
      testing::ShardedParts parts =
          testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
      for (const auto& [prefix, module] : parts) {
        FSDPModule(module).unshard();
        std::vector<std::string> names;
        std::vector<at::Tensor> flat;
        for (const auto& info : module.sharded_params()) {
          names.push_back(prefix + info.name);
          flat.push_back(reference->named_parameters()[prefix + info.name].detach().flatten());
        }
        // Per parameter, each its own row; fused, one row of the module's parameters.
        std::vector<at::Tensor> expected;
        if (fused) {
          const at::Tensor row = torch::cat(flat);
          std::vector<int64_t> sizes;
          for (const at::Tensor& t : flat) sizes.push_back(t.numel());
          expected = (quantized ? cpu_round_trip(row, codec, kBlock) : row).split_with_sizes(sizes);
        } else {
          for (const at::Tensor& t : flat) {
            expected.push_back(quantized ? cpu_round_trip(t, codec, kBlock) : t);
          }
        }
        for (size_t i = 0; i < names.size(); ++i) {
          const at::Tensor unsharded = model->named_parameters()[names[i]];
          ASSERT_TRUE(unsharded.is_cuda()) << names[i];
          EXPECT_TRUE(torch::equal(bits_of(unsharded.flatten()), bits_of(expected[i]))) << names[i];
        }
        FSDPModule(module).reshard();
      }
    }

    SCOPED_TRACE(to_string(codec) + " gradients");
    FullyShardOptions plain;
    FullyShardOptions coded;
    coded.comm_policy = {.reduce_scatter_codec = codec, .block_size = kBlock};
    Sharded<Mlp> exact = testing::build_from_seed<Mlp>(42, 5, 64, 96, 3, 3).model;
    Sharded<Mlp> model = testing::build_from_seed<Mlp>(42, 5, 64, 96, 3, 3).model;
    testing::ShardedParts exact_parts =
        testing::shard_blocks_then_root(exact->blocks, exact, "blocks.", plain);
    testing::ShardedParts parts =
        testing::shard_blocks_then_root(model->blocks, model, "blocks.", coded);
    torch::manual_seed(7);
    const at::Tensor x = torch::randn({12, 5}).to(device), y = torch::randn({12, 3}).to(device);
    torch::mse_loss(exact(x), y).backward();
    torch::mse_loss(model(x), y).backward();
    const auto exact_grads = testing::full_grads(exact_parts);
    const auto grads = testing::full_grads(parts);
    ASSERT_EQ(grads.size(), exact_grads.size());
    for (const auto& [name, grad] : exact_grads) {
      const at::Tensor want = quantized ? cpu_round_trip(grad, codec, kBlock) : grad;
      EXPECT_TRUE(torch::equal(bits_of(grads.at(name)), bits_of(want))) << name;
    }
  }
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
