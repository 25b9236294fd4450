// Activation swap of GPU tensors: out to pinned host memory and back, both copies on a
// side stream ordered by events. Skipped where this process sees no CUDA device (the
// development machines have none); on a GPU machine it checks that the swapped storages
// leave the device between forward and backward and that the gradients are bitwise those
// of the same steps without swap, with and without prefetch, and around recomputation.
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/activation_swap.h"
#include "hyperparallel/recompute.h"

namespace hp {
namespace {

constexpr int kLayers = 4;

struct Outcome {
  std::vector<at::Tensor> grads;  // of x and w, on the CPU
  int still_on_device = 0;        // intermediate activations alive between forward and backward
};

// tanh(h W) layers on the GPU; `run_layer` runs one (in a region of its own, or not).
Outcome run(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& run_layer) {
  const c10::Device gpu(at::kCUDA, 0);
  torch::manual_seed(0);
  const at::Tensor x = torch::randn({256, 512}).to(gpu).requires_grad_();
  const at::Tensor w = (torch::randn({512, 512}) / 24).to(gpu).requires_grad_();
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> intermediate;
  at::Tensor h = x * 2;
  for (int i = 0; i < kLayers; ++i) {
    intermediate.push_back(h.storage().getWeakStorageImpl());
    h = run_layer(h, w);
  }
  Outcome result;
  for (const auto& storage : intermediate) result.still_on_device += storage.lock() ? 1 : 0;
  h.pow(2).sum().backward();
  result.grads = {x.grad().cpu(), w.grad().cpu()};
  return result;
}

at::Tensor layer(const at::Tensor& h, const at::Tensor& w) { return torch::tanh(h.matmul(w)); }

void expect_bitwise_equal(const Outcome& actual, const Outcome& expected) {
  ASSERT_EQ(actual.grads.size(), expected.grads.size());
  for (size_t i = 0; i < actual.grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual.grads[i], expected.grads[i])) << "gradient " << i;
  }
}

TEST(ActivationSwapCuda, ActivationsLeaveTheGpuAndComeBackAhead) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const Outcome plain = run(layer);
  EXPECT_EQ(plain.still_on_device, kLayers);
  for (int prefetch : {0, 1}) {
    SCOPED_TRACE("prefetch_regions " + std::to_string(prefetch));
    ActivationSwap swap({.prefetch_regions = prefetch});
    const Outcome swapped = run([&](const at::Tensor& h, const at::Tensor& w) {
      SwapActivations region(swap);
      return layer(h, w);
    });
    expect_bitwise_equal(swapped, plain);
    EXPECT_EQ(swapped.still_on_device, 0);
    const ActivationSwapStats stats = swap.stats();
    EXPECT_EQ(stats.storages_swapped, kLayers + 1);
    EXPECT_EQ(stats.loads_on_demand, prefetch ? 2 : kLayers + 1);
    EXPECT_EQ(stats.unpacks_ready + stats.unpacks_waited, stats.tensors_swapped);
  }
}

TEST(ActivationSwapCuda, ComposesWithRecompute) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const Outcome plain = run(layer);
  for (RecomputeImpl impl : {RecomputeImpl::kNonReentrant, RecomputeImpl::kReentrant}) {
    SCOPED_TRACE(impl == RecomputeImpl::kReentrant ? "reentrant" : "non-reentrant");
    ActivationSwap swap;
    std::vector<c10::Device> rerun_devices;
    const Outcome swapped = run([&](const at::Tensor& h, const at::Tensor& w) {
      SwapActivations region(swap);
      return recompute(
          [&, w](const at::Tensor& in) {
            rerun_devices.push_back(in.device());
            return layer(in, w);
          },
          h, {.impl = impl});
    });
    expect_bitwise_equal(swapped, plain);
    EXPECT_EQ(swap.stats().tensors_swapped, kLayers);
    ASSERT_EQ(rerun_devices.size(), 2u * kLayers);
    for (const c10::Device& device : rerun_devices) EXPECT_TRUE(device.is_cuda()) << device;
  }
}

}  // namespace
}  // namespace hp
