// Activation swap (test plan L2-06): saved tensors leave memory between forward and
// backward (on CPU to a swap file), come back as they were, ahead of the backward that
// needs them, alone and with recomputation; with fully_shard on 2 ranks training matches
// the single-process model without swap (1e-5) and the same sharded training without
// swap bit for bit, and lowers the peak of live memory by about the swapped bytes.
#include <signal.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/activation_swap.h"
#include "hyperparallel/recompute.h"
#include "models/transformer.h"

namespace hp {
namespace {

using testing::error_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saves the given tensors for backward and hands them, as backward unpacked them, to
// `unpacked`.
struct SaveForBackward : torch::autograd::Function<SaveForBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::vector<at::Tensor>& to_save) {
    ctx->save_for_backward(to_save);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    unpacked() = ctx->get_saved_variables();
    return {grads[0], at::Tensor()};
  }
  static std::vector<at::Tensor>& unpacked() {
    static std::vector<at::Tensor> value;
    return value;
  }
};

// Storages at least this big are swapped in these tests (most of the activations).
constexpr int64_t kMinBytes = 1024;

TEST(ActivationSwap, SavedTensorsComeBackAsTheyWere) {
  torch::manual_seed(0);
  ActivationSwap swap({.min_bytes = kMinBytes});
  const at::Tensor param = torch::randn({64, 64}).requires_grad_();
  const at::Tensor x = torch::randn({8}).requires_grad_();
  std::vector<at::Tensor> expected;  // copies, compared with what comes back
  std::vector<std::vector<int64_t>> strides;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> swapped_storages;
  int64_t swapped_bytes = 0;
  at::Tensor y;
  {
    const at::Tensor a = torch::randn({64, 32});
    std::vector<at::Tensor> to_save = {
        a,
        a.t(),                                         // a view: one copy with a
        a.narrow(0, 5, 10),                            // storage offset 160
        torch::randn({48, 40}).to(at::kBFloat16).t(),  // bf16, transposed
        torch::randint(1000, {512}),                   // int64
        torch::randn({1, 512}).expand({16, 512}),      // stride 0
        torch::randn({2, 8, 4, 4}).contiguous(at::MemoryFormat::ChannelsLast),
        torch::randn({4}),  // kept: below min_bytes
        param,              // kept: a parameter
        param.t(),          // kept: a view of one
    };
    for (size_t i = 0; i < to_save.size(); ++i) {
      expected.push_back(to_save[i].detach().clone());
      strides.push_back(to_save[i].strides().vec());
      if (i < 7 && i != 1 && i != 2) {
        swapped_storages.push_back(to_save[i].storage().getWeakStorageImpl());
        swapped_bytes += static_cast<int64_t>(to_save[i].storage().nbytes());
      }
    }
    SwapActivations region(swap);
    y = SaveForBackward::apply(x, to_save);
  }
  // Between forward and backward the swapped storages are gone from memory.
  for (const auto& storage : swapped_storages) EXPECT_FALSE(storage.lock()) << "still in memory";
  ActivationSwapStats stats = swap.stats();
  EXPECT_EQ(stats.tensors_swapped, 7);
  EXPECT_EQ(stats.tensors_kept, 3);
  EXPECT_EQ(stats.storages_swapped, 5);
  EXPECT_EQ(stats.bytes_swapped_out, swapped_bytes);

  y.sum().backward();
  const auto& unpacked = SaveForBackward::unpacked();
  ASSERT_EQ(unpacked.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("saved tensor " + std::to_string(i));
    EXPECT_EQ(unpacked[i].device(), expected[i].device());
    EXPECT_EQ(unpacked[i].scalar_type(), expected[i].scalar_type());
    EXPECT_EQ(unpacked[i].sizes(), expected[i].sizes());
    EXPECT_EQ(unpacked[i].strides(), c10::IntArrayRef(strides[i]));
    EXPECT_TRUE(torch::equal(unpacked[i], expected[i]));
  }
  EXPECT_EQ(unpacked[2].storage_offset(), 160);
  // The views of one storage came back as views of one storage.
  EXPECT_TRUE(unpacked[0].storage().is_alias_of(unpacked[1].storage()));
  EXPECT_TRUE(unpacked[0].storage().is_alias_of(unpacked[2].storage()));
  // Kept ones are the very tensors.
  EXPECT_TRUE(unpacked[8].storage().is_alias_of(param.storage()));
  SaveForBackward::unpacked().clear();
  stats = swap.stats();
  EXPECT_EQ(stats.bytes_swapped_in, swapped_bytes);
  EXPECT_EQ(stats.loads_on_demand, 5);
  EXPECT_EQ(stats.unpacks_ready + stats.unpacks_waited, 7);
}

// A stack of tanh(h W) layers and the gradients of its leaves.
struct Stack {
  static constexpr int kLayers = 4;
  at::Tensor x, w;
  Stack() {
    torch::manual_seed(0);
    x = torch::randn({64, 128}).requires_grad_();
    w = (torch::randn({128, 128}) / 12).requires_grad_();
  }
  at::Tensor layer(const at::Tensor& h) const { return torch::tanh(h.matmul(w)); }
  // `run_layer` runs one layer (in a region of its own, or not).
  std::vector<at::Tensor> grads(const std::function<at::Tensor(const at::Tensor&)>& run_layer,
                                int backwards = 1) {
    at::Tensor h = x * 2;  // not a leaf: a reentrant recompute's input may be swapped
    for (int i = 0; i < kLayers; ++i) h = run_layer(h);
    const at::Tensor loss = h.pow(2).sum();
    for (int i = 0; i < backwards; ++i) loss.backward({}, /*retain_graph=*/i + 1 < backwards);
    std::vector<at::Tensor> result = {x.grad().clone(), w.grad().clone()};
    x.mutable_grad().reset();
    w.mutable_grad().reset();
    return result;
  }
};

void expect_bitwise_equal(const std::vector<at::Tensor>& actual,
                          const std::vector<at::Tensor>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i], expected[i])) << "gradient " << i;
  }
}

TEST(ActivationSwap, BackwardBringsTheNextRegionBackAhead) {
  Stack stack;
  const auto plain = stack.grads([&](const at::Tensor& h) { return stack.layer(h); });
  for (int prefetch : {0, 1}) {
    SCOPED_TRACE("prefetch_regions " + std::to_string(prefetch));
    ActivationSwap swap({.min_bytes = kMinBytes, .prefetch_regions = prefetch});
    const auto swapped = stack.grads([&](const at::Tensor& h) {
      SwapActivations region(swap);
      return stack.layer(h);
    });
    expect_bitwise_equal(swapped, plain);
    const ActivationSwapStats stats = swap.stats();
    // Per layer: h (matmul's input) and tanh's output; w is a parameter.
    EXPECT_EQ(stats.tensors_swapped, 2 * Stack::kLayers);
    EXPECT_EQ(stats.tensors_kept, Stack::kLayers);
    // h of the first, the tanh output of each (which the next one saves as its h).
    EXPECT_EQ(stats.storages_swapped, Stack::kLayers + 1);
    EXPECT_EQ(stats.bytes_swapped_in, stats.bytes_swapped_out);
    // The last region comes back when backward first needs it; with prefetch every other
    // one comes back while backward runs the region after it.
    EXPECT_EQ(stats.loads_on_demand, prefetch ? 2 : stats.storages_swapped);
    EXPECT_EQ(stats.loads_prefetched, prefetch ? stats.storages_swapped - 2 : 0);
    EXPECT_EQ(stats.unpacks_ready + stats.unpacks_waited, stats.tensors_swapped);
  }
}

TEST(ActivationSwap, BackwardTwiceThroughARetainedGraph) {
  Stack stack;
  const auto once = stack.grads([&](const at::Tensor& h) { return stack.layer(h); });
  ActivationSwap swap({.min_bytes = kMinBytes});
  const auto twice = stack.grads(
      [&](const at::Tensor& h) {
        SwapActivations region(swap);
        return stack.layer(h);
      },
      2);
  expect_bitwise_equal(twice, {2 * once[0], 2 * once[1]});
  EXPECT_EQ(swap.stats().bytes_swapped_in, 2 * swap.stats().bytes_swapped_out);
}

// Swap around recompute: what is swapped is the recompute's input, and the rerun runs on
// it back on the compute device, as it was.
TEST(ActivationSwap, ComposesWithRecompute) {
  for (RecomputeImpl impl : {RecomputeImpl::kNonReentrant, RecomputeImpl::kReentrant}) {
    SCOPED_TRACE(impl == RecomputeImpl::kReentrant ? "reentrant" : "non-reentrant");
    Stack stack;
    const auto plain = stack.grads([&](const at::Tensor& h) { return stack.layer(h); });
    ActivationSwap swap({.min_bytes = kMinBytes});
    std::vector<at::Tensor> seen;  // each run's input: forward, then the rerun in backward
    const auto recomputed = stack.grads([&](const at::Tensor& h) {
      SwapActivations region(swap);
      return recompute(
          [&](const at::Tensor& in) {
            seen.push_back(in);
            return stack.layer(in);
          },
          h, {.impl = impl});
    });
    expect_bitwise_equal(recomputed, plain);
    const ActivationSwapStats stats = swap.stats();
    EXPECT_EQ(stats.tensors_swapped, Stack::kLayers) << "one input per region";
    EXPECT_EQ(stats.tensors_kept, 0);
    EXPECT_EQ(stats.bytes_swapped_out, Stack::kLayers * 64 * 128 * 4);
    EXPECT_EQ(stats.loads_prefetched, Stack::kLayers - 1);
    ASSERT_EQ(seen.size(), 2u * Stack::kLayers);
    for (int i = 0; i < Stack::kLayers; ++i) {
      // Backward reruns the last layer first.
      const at::Tensor& forward = seen[i];
      const at::Tensor& rerun = seen[2 * Stack::kLayers - 1 - i];
      EXPECT_EQ(rerun.device(), forward.device()) << "layer " << i;
      EXPECT_EQ(rerun.scalar_type(), forward.scalar_type()) << "layer " << i;
      EXPECT_EQ(rerun.strides(), forward.strides()) << "layer " << i;
      EXPECT_TRUE(rerun.requires_grad()) << "layer " << i;
      EXPECT_TRUE(torch::equal(rerun, forward)) << "layer " << i;
    }
  }
}

TEST(ActivationSwap, ATensorModifiedInPlaceAfterItWasSavedIsReported) {
  const at::Tensor x = torch::randn({64, 64}).requires_grad_();
  ActivationSwap swap({.min_bytes = kMinBytes});
  at::Tensor y;
  {
    SwapActivations region(swap);
    y = torch::tanh(x * 2);  // tanh saves its output
  }
  y.add_(1);
  const std::string what = error_of([&] { y.sum().backward(); });
  EXPECT_NE(what.find("modified in place after it was saved"), std::string::npos) << what;
}

TEST(ActivationSwap, AnUnusableDirectoryIsNamedWithTheFix) {
  const at::Tensor x = torch::randn({64, 64}).requires_grad_();
  ActivationSwap swap({.directory = "/nonexistent/hp-swap", .min_bytes = kMinBytes});
  const std::string what = error_of([&] {
    SwapActivations region(swap);
    torch::tanh(x * 2);
  });
  EXPECT_NE(what.find("/nonexistent/hp-swap"), std::string::npos) << what;
  EXPECT_NE(what.find("ActivationSwapOptions::directory"), std::string::npos) << what;
  EXPECT_THROW(ActivationSwap({.min_bytes = -1}), c10::ValueError);
  EXPECT_THROW(ActivationSwap({.prefetch_regions = -1}), c10::ValueError);
}

// A file size limit fails the write as a full disk does.
TEST(ActivationSwap, AFailedWriteIsNamedWithTheFix) {
  const at::Tensor x = torch::randn({64, 64}).requires_grad_();
  ActivationSwap swap({.min_bytes = kMinBytes});
  rlimit unlimited{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &unlimited), 0);
  rlimit small = unlimited;
  small.rlim_cur = 4096;
  signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of killing the process
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string what = error_of([&] {
    SwapActivations region(swap);
    torch::tanh(x * 2);
  });
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &unlimited), 0);
  EXPECT_NE(what.find("hp-activation-swap-"), std::string::npos) << what;
  EXPECT_NE(what.find("Free space"), std::string::npos) << what;
  // Nothing is left half done: the next forward swaps and trains.
  at::Tensor y;
  {
    SwapActivations region(swap);
    y = torch::tanh(x * 2);
  }
  y.sum().backward();
  const at::Tensor plain = x.detach().clone().requires_grad_();
  torch::tanh(plain * 2).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), plain.grad()));
}

// --- with fully_shard -------------------------------------------------------------

using models::Transformer;
using models::TransformerConfig;

TransformerConfig swap_config() {
  return {.vocab = 96, .dim = 64, .heads = 4, .layers = 4, .ffn_hidden = 128, .max_seq = 32};
}

struct LayerPlan {
  std::vector<bool> swap;
  std::vector<std::optional<RecomputeOptions>> recompute;
};

struct StepRecord {
  double loss;
  std::map<std::string, at::Tensor> grads, params_after_step;
};

struct Training {
  std::vector<StepRecord> steps;
  ActivationSwapStats stats;
};

// Two AdamW steps of the sharded decoder with `plan`; with `compare_with_reference`, the
// single-process model without swap or recomputation runs alongside on the global batch:
// loss, global grad norm and every gradient within 1e-5 (the plan's tolerances).
Training train_two_steps(const LayerPlan& plan, bool compare_with_reference) {
  const TransformerConfig config = swap_config();
  auto [reference, model] = testing::build_from_seed<Transformer>(42, config);
  model->swap_layers = plan.swap;
  model->recompute_layers = plan.recompute;
  model->activation_swap = ActivationSwap({.min_bytes = kMinBytes});
  testing::ShardedParts parts = testing::shard_blocks_then_root(model->layers, model, "layers.");
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Training training;
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(config.vocab, {4, config.max_seq + 1});
    at::Tensor input = tokens.narrow(1, 0, config.max_seq);
    at::Tensor target = tokens.narrow(1, 1, config.max_seq);
    ref_opt.zero_grad();
    opt.zero_grad();
    const testing::StepLosses losses = testing::backward_on_global_batch(
        reference, model, input, target, testing::token_cross_entropy);
    StepRecord record{
        testing::mean_over_ranks(losses.local).item<double>(), testing::full_grads(parts), {}};
    if (compare_with_reference) {
      EXPECT_NEAR(record.loss, losses.reference.item<double>(), 1e-5) << "loss";
      const auto ref_grads = testing::reference_grads(*reference);
      EXPECT_EQ(record.grads.size(), ref_grads.size()) << "parameters with a gradient";
      EXPECT_NEAR(testing::norm_of(record.grads), testing::norm_of(ref_grads), 1e-5) << "grad norm";
      testing::expect_all_close(record.grads, ref_grads, 1e-5, "grad");
    }
    ref_opt.step();
    opt.step();
    record.params_after_step = testing::full_params(parts);
    training.steps.push_back(std::move(record));
  }
  training.stats = model->activation_swap.stats();
  return training;
}

void expect_bitwise_equal(const Training& actual, const Training& expected,
                          const std::string& what) {
  ASSERT_EQ(actual.steps.size(), expected.steps.size());
  for (size_t step = 0; step < expected.steps.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step) + ": " + what);
    EXPECT_EQ(actual.steps[step].loss, expected.steps[step].loss);
    for (const auto& field : {&StepRecord::grads, &StepRecord::params_after_step}) {
      const auto& want = expected.steps[step].*field;
      const auto& got = actual.steps[step].*field;
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, tensor] : want) {
        EXPECT_TRUE(torch::equal(got.at(name), tensor)) << name;
      }
    }
  }
}

HP_DIST_TEST(FullyShardWithActivationSwap, L2_06_SwapMatchesReference, 2) {
  const int layers = static_cast<int>(swap_config().layers);
  const LayerPlan swap_all{.swap = std::vector<bool>(layers, true), .recompute = {}};
  const Training plain = train_two_steps({}, /*compare_with_reference=*/false);
  const Training swapped = train_two_steps(swap_all, /*compare_with_reference=*/true);
  // Swap copies bytes and brings them back: not a bit may change.
  expect_bitwise_equal(swapped, plain, "swap vs no swap");
  expect_bitwise_equal(train_two_steps(swap_all, false), swapped, "rerun with swap");
  EXPECT_GT(swapped.stats.bytes_swapped_out, 0);
  EXPECT_GT(swapped.stats.loads_prefetched, 0);

  // With recomputation of every layer: only each layer's input is swapped.
  for (RecomputeImpl impl : {RecomputeImpl::kNonReentrant, RecomputeImpl::kReentrant}) {
    SCOPED_TRACE(impl == RecomputeImpl::kReentrant ? "reentrant" : "non-reentrant");
    LayerPlan plan = swap_all;
    plan.recompute.assign(layers, RecomputeOptions{.impl = impl});
    const Training composed = train_two_steps(plan, /*compare_with_reference=*/true);
    expect_bitwise_equal(composed, plain, "swap and recompute vs neither");
    // Two steps, one input [2, 32, 64] per layer.
    EXPECT_EQ(composed.stats.tensors_swapped, 2 * layers);
    EXPECT_EQ(composed.stats.bytes_swapped_out, 2 * layers * 2 * 32 * 64 * 4);
  }
}

struct StepMemory {
  int64_t after_forward;  // live bytes between forward and backward, above the step's start
  int64_t peak;           // the high-water mark of forward + backward, above the step's start
  ActivationSwapStats stats;
};

constexpr int64_t kMemoryLayers = 8;

// The second step of the decoder with 8 layers (sequence 64, 4 sequences per rank:
// activations outweigh the parameters), every layer swapped or none.
StepMemory memory_of_a_step(bool swap) {
  TransformerConfig config = swap_config();
  config.layers = kMemoryLayers;
  config.max_seq = 64;
  torch::manual_seed(42);
  Sharded<Transformer> model(config);
  if (swap) model->swap_layers.assign(config.layers, true);
  model->activation_swap = ActivationSwap({.min_bytes = kMinBytes});
  testing::shard_blocks_then_root(model->layers, model, "layers.");
  torch::manual_seed(7);
  at::Tensor tokens = torch::randint(config.vocab, {4, config.max_seq + 1});
  const auto loss = [&] {
    return testing::token_cross_entropy(model(tokens.narrow(1, 0, config.max_seq)),
                                        tokens.narrow(1, 1, config.max_seq));
  };
  loss().backward();
  model->zero_grad();
  const ActivationSwapStats first = model->activation_swap.stats();
  auto& probe = testing::CpuMemoryProbe::installed();
  const int64_t before = probe.settled_live();
  probe.reset_peak();
  at::Tensor value = loss();
  const int64_t after_forward = probe.settled_live() - before;
  value.backward();
  StepMemory memory{after_forward, probe.peak_above(before), model->activation_swap.stats()};
  // This step's counts.
  memory.stats.tensors_swapped -= first.tensors_swapped;
  memory.stats.storages_swapped -= first.storages_swapped;
  memory.stats.bytes_swapped_out -= first.bytes_swapped_out;
  memory.stats.loads_prefetched -= first.loads_prefetched;
  memory.stats.loads_on_demand -= first.loads_on_demand;
  memory.stats.unpacks_ready -= first.unpacks_ready;
  memory.stats.unpacks_waited -= first.unpacks_waited;
  return memory;
}

HP_DIST_TEST(FullyShardWithActivationSwap, SwapFreesActivationsAndPrefetches, 2) {
  testing::CpuMemoryProbe::installed();  // counting from the start of both runs
  const StepMemory plain = memory_of_a_step(false);
  const StepMemory swapped = memory_of_a_step(true);
  const ActivationSwapStats& stats = swapped.stats;
  ASSERT_GT(stats.bytes_swapped_out, 0);
  ASSERT_EQ(stats.bytes_swapped_out % kMemoryLayers, 0);
  const int64_t region = stats.bytes_swapped_out / kMemoryLayers;  // the layers are alike
  std::printf(
      "live after forward: %lld without swap, %lld with; peak: %lld without, %lld with; "
      "swapped %lld bytes in %lld storages (%lld per layer); loads prefetched %lld, on "
      "demand %lld; unpacks ready %lld, waited %lld\n",
      static_cast<long long>(plain.after_forward), static_cast<long long>(swapped.after_forward),
      static_cast<long long>(plain.peak), static_cast<long long>(swapped.peak),
      static_cast<long long>(stats.bytes_swapped_out),
      static_cast<long long>(stats.storages_swapped), static_cast<long long>(region),
      static_cast<long long>(stats.loads_prefetched), static_cast<long long>(stats.loads_on_demand),
      static_cast<long long>(stats.unpacks_ready), static_cast<long long>(stats.unpacks_waited));
  // Between forward and backward every swapped byte is out of memory, and nothing else.
  EXPECT_EQ(plain.after_forward - swapped.after_forward, stats.bytes_swapped_out);
  // The peak. Swap cannot lower it by more than it swapped. Without swap it comes at the
  // start of backward, holding every activation. With swap, backward in layer i holds
  // layers i and i - 1 back (prefetch 1), plus that layer's backward memory, the gradients
  // accumulated so far and fully_shard's buffers in flight (whose timing differs between
  // runs): about half a layer's activations at these sizes (measured: the peak is lower by
  // all but 2.4 to 2.6 layers). The test allows one layer's: lower by at least all but three.
  EXPECT_LE(plain.peak - swapped.peak, stats.bytes_swapped_out);
  EXPECT_GE(plain.peak - swapped.peak, stats.bytes_swapped_out - 3 * region);
  // Backward loads the last layer on demand, each other one while it runs the layer after.
  EXPECT_EQ(stats.loads_on_demand, stats.storages_swapped / kMemoryLayers);
  EXPECT_EQ(stats.loads_prefetched, stats.storages_swapped - stats.loads_on_demand);
  EXPECT_EQ(stats.unpacks_ready + stats.unpacks_waited, stats.tensors_swapped);
  EXPECT_GT(stats.unpacks_ready, 0) << "no prefetched tensor was back when backward needed it";
}

}  // namespace
}  // namespace hp
