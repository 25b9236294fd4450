// A training run whose every number is printed exactly, for comparing runs that must be
// bitwise equal: the same run with the communication streams on or off
// (HP_DEBUG_STREAMS=serial), with delays injected (HP_DEBUG_STREAMS=delay), with
// CUDA_LAUNCH_BLOCKING=1, with one-rank groups communicating or not. A missing stream
// ordering shows as a difference. Nothing reads the device until the end (a per-step
// .item() would drain it and hide races): the losses and gradient norms stay on the
// device, and the end prints them with %.9g and an fp64 checksum of every shard.
//
// --probe runs one block on its own after each optimizer step, behind a slow optimizer
// (a device sleep queued before the step): its all-gather must read the updated shards.
// --codec int8|fp8 quantizes the all-gathers and reduce-scatters (comm_codec.h: on the
// GPU by tensor operations on the lanes), --error-feedback keeps their residuals; the
// codecs quantize only where something travels, so compare such runs with one-rank groups
// communicating in every mode.
// --report prints to stderr (it differs between modes) the longest host time of a
// forward after the first two steps, and the device memory allocated and reserved after
// step 10 and after the last step: with lanes sleeping, a forward that only issues work
// stays short; in a steady loop the memory stays the same.
//
//   hp-run -n 1 -- build/tests/stream_check [--steps N] [--mp none|bf16|fp16]
//       [--fusion] [--replicate] [--keep] [--recompute] [--probe] [--report]
//       [--codec none|int8|fp8] [--error-feedback]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#ifdef HP_WITH_NCCL
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "hyperparallel/comm_codec.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/recompute.h"

namespace {

struct Options {
  int steps = 30;
  int width = 256;
  int blocks = 4;
  std::string mp = "none";
  bool fusion = false;
  bool replicate = false;
  bool keep = false;  // reshard_after_forward = false
  bool recompute = false;
  bool probe = false;
  bool report = false;
  hp::CommCodec codec = hp::CommCodec::kNone;
  bool error_feedback = false;
};

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  explicit BlockImpl(int width) {
    up = register_module("up", torch::nn::Linear(width, 4 * width));
    down = register_module("down", torch::nn::Linear(4 * width, width));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  std::vector<hp::Sharded<Block>> blocks;
  torch::nn::Linear head{nullptr};
  bool recompute = false;
  NetImpl(int width, int count, bool recompute_blocks) : recompute(recompute_blocks) {
    for (int i = 0; i < count; ++i) {
      blocks.emplace_back(register_module("block" + std::to_string(i), Block(width)));
    }
    head = register_module("head", torch::nn::Linear(width, width));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) {
      x = recompute ? hp::recompute([&block](const at::Tensor& in) { return block(in); }, x)
                    : block(x);
    }
    return head(x);
  }
};
TORCH_MODULE(Net);

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&] {
      TORCH_CHECK_VALUE(i + 1 < argc, arg, " needs a value");
      return std::string(argv[++i]);
    };
    if (arg == "--steps")
      options.steps = std::stoi(value());
    else if (arg == "--width")
      options.width = std::stoi(value());
    else if (arg == "--blocks")
      options.blocks = std::stoi(value());
    else if (arg == "--mp")
      options.mp = value();
    else if (arg == "--fusion")
      options.fusion = true;
    else if (arg == "--replicate")
      options.replicate = true;
    else if (arg == "--keep")
      options.keep = true;
    else if (arg == "--recompute")
      options.recompute = true;
    else if (arg == "--probe")
      options.probe = true;
    else if (arg == "--report")
      options.report = true;
    else if (arg == "--codec")
      options.codec = hp::parse_comm_codec(value());
    else if (arg == "--error-feedback")
      options.error_feedback = true;
    else
      TORCH_CHECK_VALUE(false, "unknown option ", arg);
  }
  TORCH_CHECK_VALUE(options.mp == "none" || options.mp == "bf16" || options.mp == "fp16",
                    "--mp is none, bf16 or fp16");
  return options;
}

// A slow optimizer: the device is busy for about 20 ms before the step's kernels run.
void delay_compute(const c10::Device& device) {
#ifdef HP_WITH_NCCL
  if (device.is_cuda()) at::cuda::sleep(40'000'000);
#endif
  (void)device;
}

// Device memory allocated and reserved now, in bytes.
void report_memory(const c10::Device& device, int step) {
#ifdef HP_WITH_NCCL
  if (device.is_cuda()) {
    using c10::CachingAllocator::StatType;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    std::fprintf(stderr, "memory after step %d: allocated %lld reserved %lld\n", step,
                 static_cast<long long>(stats.allocated_bytes[all].current),
                 static_cast<long long>(stats.reserved_bytes[all].current));
  }
#endif
  (void)device;
  (void)step;
}

int run(const Options& options) {
  auto world = hp::default_world();
  const c10::Device device = world->device();
  torch::manual_seed(0);
  hp::Sharded<Net> net(Net(options.width, options.blocks, options.recompute));
  hp::FullyShardOptions shard;
  shard.comm_fusion = options.fusion;
  if (options.keep) shard.reshard_after_forward = false;
  shard.comm_policy.all_gather_codec = options.codec;
  shard.comm_policy.reduce_scatter_codec = options.codec;
  shard.comm_policy.error_feedback = options.error_feedback;
  if (options.mp != "none") {
    shard.mp_policy.param_dtype = options.mp == "bf16" ? at::kBFloat16 : at::kHalf;
    shard.mp_policy.reduce_dtype = at::kFloat;
  }
  for (auto& block : net->blocks) {
    hp::FullyShardOptions block_shard = shard;
    // The norms' parameters stay replicated: all-reduced instead of reduce-scattered.
    if (options.replicate) block_shard.replicate_params = block->norm->parameters();
    hp::fully_shard(block, block_shard);
  }
  hp::fully_shard(net, shard);
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-3));

  // Written on the device each step, read at the end; allocated once, so that device
  // memory stays the same from step to step.
  const auto on_device = at::TensorOptions(at::kDouble).device(device);
  at::Tensor losses = at::zeros({options.steps}, on_device);
  at::Tensor norms = at::zeros({options.steps}, on_device);
  at::Tensor probes = at::zeros({options.steps}, on_device);
  double longest_forward_ms = 0;
  const auto batch_for = [&](int step) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
    at::Tensor x = at::randn({64, options.width}, generator);
    at::Tensor y = at::randn({64, options.width}, generator);
    return std::make_pair(x.to(device), y.to(device));
  };
  for (int step = 0; step < options.steps; ++step) {
    auto [x, y] = batch_for(step);
    optimizer.zero_grad();
    const auto forward_began = std::chrono::steady_clock::now();
    at::Tensor out = net(x);
    const std::chrono::duration<double, std::milli> forward_took =
        std::chrono::steady_clock::now() - forward_began;
    if (step >= 2) longest_forward_ms = std::max(longest_forward_ms, forward_took.count());
    at::Tensor loss = torch::mse_loss(out.to(at::kFloat), y);
    loss.backward();
    at::Tensor squares = at::zeros({}, on_device);
    for (const auto& p : net->parameters()) {
      if (p.grad().defined()) squares += p.grad().to(at::kDouble).square().sum();
    }
    losses[step].copy_(loss.detach());
    norms[step].copy_(squares.sqrt());
    if (options.probe) delay_compute(device);
    optimizer.step();
    if (options.probe) {
      torch::NoGradGuard no_grad;
      probes[step].copy_(net->blocks[1](x).to(at::kDouble).sum());
    }
    if (options.report && (step + 1 == 10 || step + 1 == options.steps)) {
      report_memory(device, step + 1);
    }
  }
  if (options.report) {
    std::fprintf(stderr, "longest host time of a forward after step 2: %.3f ms\n",
                 longest_forward_ms);
  }
  const at::Tensor all_losses = losses.to(at::kCPU), all_norms = norms.to(at::kCPU);
  const at::Tensor all_probes = probes.to(at::kCPU);
  for (int step = 0; step < options.steps; ++step) {
    std::printf("step %d loss %.9g grad_norm %.9g", step, all_losses[step].item<double>(),
                all_norms[step].item<double>());
    if (options.probe) std::printf(" probe %.9g", all_probes[step].item<double>());
    std::printf("\n");
  }
  double checksum = 0;
  for (const auto& p : net->parameters()) {
    const at::Tensor flat = p.detach().to(at::kCPU, at::kDouble).flatten();
    checksum += (flat * at::arange(1, flat.numel() + 1, flat.options())).sum().item<double>();
  }
  std::printf("checksum %.17g on %s\n", checksum, device.str().c_str());
  world->shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const c10::Error& error) {
    std::fprintf(stderr, "stream_check: %s\n", error.what_without_backtrace());
    return 1;
  }
}
