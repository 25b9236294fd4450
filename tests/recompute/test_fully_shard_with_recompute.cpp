// Activation recomputation with fully_shard on 2 ranks (test plan L2-03..L2-05), against
// the single-process model without recomputation on the global batch (loss, every
// gradient, per-layer gradient norms within 1e-5) and bitwise against the same sharded
// training without recomputation (losses, gradients, parameters after AdamW steps).
//   L2-03: every decoder layer recomputed, reentrant.
//   L2-04: the same, non-reentrant; and a lower peak of live CPU memory than without.
//   L2-05: selective (layers 1 and 3): fully_shard's forward hooks run twice per step for
//          those layers (forward, recompute) and once for the others.
// Also the other order of composition: a fully_shard-ed module whose forward recomputes
// part of itself; recomputation with quantized collectives, bitwise as well; and early stop
// leaving fully_shard-ed blocks mid-forward.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/comm_codec.h"
#include "hyperparallel/recompute.h"
#include "hyperparallel/trace.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;
using LayerPlan = std::vector<std::optional<RecomputeOptions>>;

TransformerConfig ac_config() {
  return {.vocab = 96, .dim = 64, .heads = 4, .layers = 4, .ffn_hidden = 128, .max_seq = 32};
}

// Gradient norm of each decoder layer ("layers.<i>.").
std::map<std::string, double> per_layer_norms(const std::map<std::string, at::Tensor>& grads) {
  std::map<std::string, double> squares;
  for (const auto& [name, grad] : grads) {
    if (!name.starts_with("layers.")) continue;
    const std::string layer = name.substr(0, name.find('.', 7) + 1);
    squares[layer] += grad.to(at::kDouble).pow(2).sum().item<double>();
  }
  for (auto& [layer, value] : squares) value = std::sqrt(value);
  return squares;
}

struct StepRecord {
  double loss;
  std::map<std::string, at::Tensor> grads, params_after_step;
};

// Two AdamW steps of the sharded model with `plan`. With `reference`, the single-process
// model runs alongside on the global batch and is compared at the plan's tolerance:
// loss, every gradient, per-layer gradient norms.
std::vector<StepRecord> train_two_steps(const LayerPlan& plan, bool compare_with_reference,
                                        const FullyShardOptions& options = {}) {
  const TransformerConfig config = ac_config();
  auto [reference, model] = testing::build_from_seed<Transformer>(42, config);
  model->recompute_layers = plan;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<StepRecord> records;
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
      auto ref_grads = testing::reference_grads(*reference);
      EXPECT_EQ(record.grads.size(), ref_grads.size()) << "parameters with a gradient";
      testing::expect_all_close(record.grads, ref_grads, 1e-5, "grad");
      const auto norms = per_layer_norms(record.grads), ref_norms = per_layer_norms(ref_grads);
      EXPECT_EQ(norms.size(), static_cast<size_t>(config.layers));
      for (const auto& [layer, norm] : ref_norms) {
        EXPECT_NEAR(norms.at(layer), norm, 1e-5) << "grad norm of " << layer;
      }
    }
    ref_opt.step();
    opt.step();
    record.params_after_step = testing::full_params(parts);
    records.push_back(std::move(record));
  }
  return records;
}

void expect_bitwise_equal(const std::map<std::string, at::Tensor>& actual,
                          const std::map<std::string, at::Tensor>& expected,
                          const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, tensor] : expected) {
    EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << what << " " << name;
  }
}

void expect_same_training(const std::vector<StepRecord>& recomputed,
                          const std::vector<StepRecord>& plain) {
  for (size_t step = 0; step < plain.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step) + " vs no recomputation");
    EXPECT_EQ(recomputed[step].loss, plain[step].loss);
    expect_bitwise_equal(recomputed[step].grads, plain[step].grads, "grad");
    expect_bitwise_equal(recomputed[step].params_after_step, plain[step].params_after_step,
                         "param after step");
  }
}

// Against the reference at the plan's tolerances, and bitwise against the same sharded
// training without recomputation: a recompute performs the same operations in the same
// order, so recomputation must not change a single bit.
void expect_recomputed_training_matches_reference(const LayerPlan& plan) {
  expect_same_training(train_two_steps(plan, /*compare_with_reference=*/true),
                       train_two_steps({}, /*compare_with_reference=*/false));
}

LayerPlan every_layer(RecomputeImpl impl, std::optional<bool> early_stop = std::nullopt) {
  return LayerPlan(ac_config().layers, RecomputeOptions{.impl = impl, .early_stop = early_stop});
}

HP_DIST_TEST(FullyShardWithRecompute, ReentrantMatchesReference, 2) {
  expect_recomputed_training_matches_reference(every_layer(RecomputeImpl::kReentrant));
}

HP_DIST_TEST(FullyShardWithRecompute, NonReentrantMatchesReference, 2) {
  expect_recomputed_training_matches_reference(every_layer(RecomputeImpl::kNonReentrant));
}

// With int8 all-gathers and reduce-scatters (and error feedback) recomputation changes no
// bit either: the recomputed forward reads the weights the backward all-gather
// dequantized, which equal the forward's.
HP_DIST_TEST(FullyShardWithRecompute, QuantizedCollectivesStayBitwiseEqual, 2) {
  FullyShardOptions quantized;
  quantized.comm_policy = {.all_gather_codec = CommCodec::kInt8,
                           .reduce_scatter_codec = CommCodec::kInt8,
                           .block_size = 64,
                           .error_feedback = true};
  const auto plain = train_two_steps({}, /*compare_with_reference=*/false, quantized);
  expect_same_training(train_two_steps(every_layer(RecomputeImpl::kNonReentrant), false, quantized),
                       plain);
  expect_same_training(train_two_steps(every_layer(RecomputeImpl::kReentrant), false, quantized),
                       plain);
  EXPECT_NE(plain.front().loss, train_two_steps({}, false).front().loss) << "nothing was quantized";
}

// Peak live CPU bytes above the start of one forward + backward (sequence 64, 4 sequences
// per rank: activations outweigh the parameters).
int64_t peak_bytes_of_one_step(const LayerPlan& plan) {
  TransformerConfig config = ac_config();
  config.max_seq = 64;
  torch::manual_seed(42);
  Sharded<Transformer> model(config);
  model->recompute_layers = plan;
  testing::shard_blocks_then_root(model->layers, model, "layers.");
  torch::manual_seed(7);
  at::Tensor tokens = torch::randint(config.vocab, {4, config.max_seq + 1});
  auto& probe = testing::CpuMemoryProbe::installed();
  const int64_t before = probe.live();
  probe.reset_peak();
  testing::token_cross_entropy(model(tokens.narrow(1, 0, config.max_seq)),
                               tokens.narrow(1, 1, config.max_seq))
      .backward();
  return probe.peak_above(before);
}

HP_DIST_TEST(FullyShardWithRecompute, RecomputationLowersPeakMemory, 2) {
  const int64_t baseline = peak_bytes_of_one_step({});
  const int64_t non_reentrant = peak_bytes_of_one_step(every_layer(RecomputeImpl::kNonReentrant));
  const int64_t reentrant = peak_bytes_of_one_step(every_layer(RecomputeImpl::kReentrant));
  std::printf("peak bytes above step start: no AC %lld, non-reentrant %lld, reentrant %lld\n",
              static_cast<long long>(baseline), static_cast<long long>(non_reentrant),
              static_cast<long long>(reentrant));
  EXPECT_LT(non_reentrant, baseline);
  EXPECT_LT(reentrant, baseline);
}

HP_DIST_TEST(FullyShardWithRecompute, SelectiveRecomputeRunsOnlyThoseLayers, 2) {
  LayerPlan plan(ac_config().layers);
  plan[1] = plan[3] = RecomputeOptions{.impl = RecomputeImpl::kNonReentrant};
  expect_recomputed_training_matches_reference(plan);

  // One traced step: fully_shard's forward hook runs for the forward and, in
  // recomputed layers only, for the recompute.
  const TransformerConfig config = ac_config();
  torch::manual_seed(42);
  Sharded<Transformer> model(config);
  model->recompute_layers = plan;
  testing::shard_blocks_then_root(model->layers, model, "layers.");
  at::Tensor tokens = torch::randint(config.vocab, {2, config.max_seq + 1});
  trace::start();
  testing::token_cross_entropy(model(tokens.narrow(1, 0, config.max_seq)),
                               tokens.narrow(1, 1, config.max_seq))
      .backward();
  std::vector<std::string> events;
  for (const auto& event : trace::stop()) events.push_back(trace::describe(event));
  auto count = [&](const std::string& line) {
    return std::count(events.begin(), events.end(), line);
  };
  auto position = [&](const std::string& line) {
    return std::find(events.begin(), events.end(), line) - events.begin();
  };
  for (int64_t i = 0; i < config.layers; ++i) {
    const std::string layer = "layers." + std::to_string(i);
    const int64_t expected_runs = plan[i] ? 2 : 1;
    EXPECT_EQ(count("forward begin " + layer) + count("recompute begin " + layer), expected_runs)
        << layer;
    EXPECT_EQ(count("recompute begin " + layer), plan[i] ? 1 : 0) << layer;
    // A recompute happens inside the layer's own backward, on gathered parameters.
    if (plan[i]) {
      EXPECT_LT(position("backward begin " + layer), position("recompute begin " + layer));
    }
  }
  // Gradient reduction still runs layer by layer during backward, not at its end.
  EXPECT_LT(position("RS issue layers.3"), position("backward begin layers.1"));

  // The next step prefetches in the previous forward's order: the all-gather of layer
  // i + 1 (not a later one) is first issued while layer i's forward runs.
  trace::start();
  testing::token_cross_entropy(model(tokens.narrow(1, 0, config.max_seq)),
                               tokens.narrow(1, 1, config.max_seq))
      .backward();
  events.clear();
  for (const auto& event : trace::stop()) events.push_back(trace::describe(event));
  for (int64_t i = 0; i + 1 < config.layers; ++i) {
    const std::string layer = "layers." + std::to_string(i);
    const std::string next = "layers." + std::to_string(i + 1);
    EXPECT_LT(position("forward begin " + layer), position("AG issue " + next)) << next;
    EXPECT_LT(position("AG issue " + next), position("forward end " + layer)) << next;
  }
}

// A block that recomputes its own MLP: fully_shard outside, recompute inside.
struct SelfRecomputingBlockImpl : torch::nn::Module {
  SelfRecomputingBlockImpl(int64_t dim, std::optional<RecomputeImpl> impl)
      : fc1(register_module("fc1", torch::nn::Linear(dim, 2 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(2 * dim, dim))),
        impl(impl) {}
  at::Tensor forward(const at::Tensor& x) {
    auto mlp = [this](const at::Tensor& h) { return fc2(torch::gelu(fc1(h))); };
    return x + (impl ? recompute(mlp, x, {.impl = *impl}) : mlp(x));
  }
  torch::nn::Linear fc1, fc2;
  std::optional<RecomputeImpl> impl;
};
TORCH_MODULE(SelfRecomputingBlock);

struct SelfRecomputingNetImpl : torch::nn::Module {
  // The input projection makes every block's input require grad, as a reentrant
  // recompute needs.
  SelfRecomputingNetImpl(int64_t dim, std::optional<RecomputeImpl> impl)
      : proj(register_module("proj", torch::nn::Linear(dim, dim))),
        head(register_module("head", torch::nn::Linear(dim, 1))) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      blocks.emplace_back(SelfRecomputingBlock(dim, impl));
      list->push_back(blocks.back().ptr());
    }
  }
  at::Tensor forward(at::Tensor x) {
    x = proj(x);
    for (auto& block : blocks) x = block(x);
    return head(x);
  }
  torch::nn::Linear proj;
  std::vector<Sharded<SelfRecomputingBlock>> blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(SelfRecomputingNet);

HP_DIST_TEST(FullyShardWithRecompute, RecomputeInsideAShardedModule, 2) {
  for (RecomputeImpl impl : {RecomputeImpl::kNonReentrant, RecomputeImpl::kReentrant}) {
    SCOPED_TRACE(impl == RecomputeImpl::kReentrant ? "reentrant" : "non-reentrant");
    torch::manual_seed(3);
    SelfRecomputingNet reference(16, std::nullopt);
    torch::manual_seed(3);
    Sharded<SelfRecomputingNet> model(16, impl);
    testing::ShardedParts parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.");
    torch::manual_seed(11);
    testing::expect_training_matches_reference(
        reference, model, parts, 2,
        [] { return std::pair{torch::randn({8, 16}), torch::randn({8, 1})}; }, testing::mse_loss,
        1e-5, /*expect_every_param_managed=*/true);
  }
}

// A block whose last saved tensor is the input of its last matmul, counting the runs of
// what follows that tensor.
struct TailCountingBlockImpl : torch::nn::Module {
  TailCountingBlockImpl(int64_t dim, int& tail_runs)
      : fc1(register_module("fc1", torch::nn::Linear(dim, 2 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(2 * dim, dim))),
        tail_runs(tail_runs) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out = fc2(torch::gelu(fc1(x)));  // fc2 saves its input, then computes
    ++tail_runs;
    return out;
  }
  torch::nn::Linear fc1, fc2;
  int& tail_runs;
};
TORCH_MODULE(TailCountingBlock);

struct RecomputedBlocksNetImpl : torch::nn::Module {
  RecomputedBlocksNetImpl(int64_t dim, RecomputeOptions options)
      : head(register_module("head", torch::nn::Linear(dim, 1))), options(options) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      blocks.emplace_back(TailCountingBlock(dim, tail_runs));
      list->push_back(blocks.back().ptr());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) {
      x = recompute([block](const at::Tensor& h) mutable { return block(h); }, x, options);
    }
    return head(x);
  }
  int tail_runs = 0;
  std::vector<Sharded<TailCountingBlock>> blocks;
  torch::nn::Linear head;
  RecomputeOptions options;
};
TORCH_MODULE(RecomputedBlocksNet);

// Early stop ends the rerun of each recomputed block inside its fully_shard-ed forward (the
// stop passes through fully_shard's forward hooks): the tail of each block runs in forward
// only, and two AdamW steps give the gradients and parameters of whole reruns bit for bit.
HP_DIST_TEST(FullyShardWithRecompute, EarlyStopLeavesShardedBlocksAndTrainsAsWholeReruns, 2) {
  std::map<bool, std::vector<std::map<std::string, at::Tensor>>> results;
  for (bool early_stop : {true, false}) {
    SCOPED_TRACE(early_stop ? "early stop" : "whole reruns");
    torch::manual_seed(5);
    Sharded<RecomputedBlocksNet> model(16, RecomputeOptions{.early_stop = early_stop});
    testing::ShardedParts parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.");
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::manual_seed(11);
    for (int step = 0; step < 2; ++step) {
      const at::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 1});
      opt.zero_grad();
      model->tail_runs = 0;
      torch::mse_loss(model(x), y).backward();
      EXPECT_EQ(model->tail_runs, early_stop ? 3 : 6) << "step " << step;
      results[early_stop].push_back(testing::full_grads(parts));
      opt.step();
      results[early_stop].push_back(testing::full_params(parts));
    }
  }
  ASSERT_EQ(results[true].size(), results[false].size());
  for (size_t i = 0; i < results[true].size(); ++i) {
    expect_bitwise_equal(results[true][i], results[false][i],
                         i % 2 == 0 ? "grad of step " + std::to_string(i / 2)
                                    : "param after step " + std::to_string(i / 2));
  }
}

}  // namespace
}  // namespace hp
