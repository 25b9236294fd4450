// fully_shard options that change what is sharded, how it is laid out, how it is
// communicated and in which dtypes it is computed, each checked against an independent
// single-process run of the same model (built from the same seed):
//   ignored_params, shard_placement_fn (Shard(1) / Replicate()), comm_fusion, and the
//   mixed-precision policy (bf16 params + fp32 reduce, all bf16, cast_forward_inputs,
//   fp32 main grads; on sharded and on replicated parameters).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

constexpr double kTol = 1e-5;
constexpr int64_t kIn = 5, kDim = 7, kHidden = 9, kOut = 3, kBlocks = 3;
constexpr int64_t kBatch = 12;  // divisible by 2 and 3: every rank gets the same count

// The residual MLP of models/mlp.h, but its forwards record the dtype of the weights
// they compute with and of the input they receive: mixed precision is only visible
// from inside forward (between steps the parameters are the original-dtype shards).
struct RecordingBlockImpl : torch::nn::Module {
  RecordingBlockImpl(int64_t dim, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) {
    weight_dtypes.push_back(fc1->weight.scalar_type());
    input_dtypes.push_back(x.scalar_type());
    return x + fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1, fc2;
  std::vector<c10::ScalarType> weight_dtypes, input_dtypes;
};
TORCH_MODULE(RecordingBlock);

struct RecordingMlpImpl : torch::nn::Module {
  RecordingMlpImpl() : input(register_module("input", torch::nn::Linear(kIn, kDim))) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.emplace_back(RecordingBlock(kDim, kHidden));
      list->push_back(blocks.back().ptr());
    }
    head = register_module("head", torch::nn::Linear(kDim, kOut));
  }
  at::Tensor forward(const at::Tensor& x) {
    weight_dtypes.push_back(input->weight.scalar_type());
    input_dtypes.push_back(x.scalar_type());
    at::Tensor h = input(x);
    for (auto& block : blocks) h = block(h);
    return head(h);
  }
  torch::nn::Linear input;
  std::vector<Sharded<RecordingBlock>> blocks;
  torch::nn::Linear head{nullptr};
  std::vector<c10::ScalarType> weight_dtypes, input_dtypes;
};
TORCH_MODULE(RecordingMlp);

// Blocks first, then the root, as the API requires.
template <typename Model>
testing::ShardedParts shard_model(Model& model, const FullyShardOptions& block_options,
                                  const FullyShardOptions& root_options) {
  return testing::shard_blocks_then_root(model->blocks, model, "blocks.", block_options,
                                         root_options);
}

// Averaged in double.
double mean_over_ranks(const at::Tensor& value) {
  return testing::mean_over_ranks(value.detach().to(at::kDouble).reshape({1})).item<double>();
}

using testing::max_abs_diff;

std::map<std::string, at::Tensor> cloned_grads(torch::nn::Module& module) {
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : module.named_parameters()) {
    grads[item.key()] = item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
  }
  return grads;
}

// What FSDP with a low-precision param_dtype and an fp32 reduce_dtype must produce: each
// rank's share of the global batch through `model` (already in `dtype`; input cast to it,
// loss in fp32), its gradients cast to fp32 and averaged over the ranks in fp32.
template <typename Model>
std::map<std::string, at::Tensor> mean_of_local_fp32_grads(Model& model, const at::Tensor& x,
                                                           const at::Tensor& y, int64_t ranks,
                                                           c10::ScalarType dtype) {
  std::map<std::string, at::Tensor> mean;
  for (int64_t r = 0; r < ranks; ++r) {
    model->zero_grad();
    torch::mse_loss(model(testing::local_batch(x, r, ranks).to(dtype)).to(at::kFloat),
                    testing::local_batch(y, r, ranks))
        .backward();
    for (const auto& [name, grad] : testing::reference_grads(*model)) {
      at::Tensor g = grad.to(at::kFloat);
      mean[name] = mean.count(name) ? mean[name] + g : g;
    }
  }
  for (auto& [name, g] : mean) g = g / static_cast<double>(ranks);
  return mean;
}

// Every parameter is in `param_dtype`; its gradient exists and is in `grad_dtype`.
template <typename Model>
void expect_param_and_grad_dtypes(Model& model, c10::ScalarType param_dtype,
                                  c10::ScalarType grad_dtype) {
  for (const auto& item : model->named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), param_dtype) << item.key();
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_EQ(item.value().grad().scalar_type(), grad_dtype) << item.key();
  }
}

// L1_10 / L1_11: one backward of the bf16 reference on the global batch and of `model` on
// this rank's share, whose output must come out in `output_dtype`.
struct Bf16Step {
  at::Tensor x, y;  // the global batch
  at::Tensor ref_loss, loss;
};

Bf16Step bf16_backward(RecordingMlp& reference, Sharded<RecordingMlp>& model,
                       c10::ScalarType output_dtype) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  Bf16Step step;
  torch::manual_seed(7);
  step.x = torch::randn({kBatch, kIn});
  step.y = torch::randn({kBatch, kOut});

  // The loss is taken in fp32 on both sides: a bf16 loss near 1 is itself only resolved
  // to 2^-8, which would make a 1e-3 comparison a coin toss.
  step.ref_loss = torch::mse_loss(reference(step.x.to(at::kBFloat16)).to(at::kFloat), step.y);
  step.ref_loss.backward();

  at::Tensor out = model(testing::local_batch(step.x, rank, ranks));
  EXPECT_EQ(out.scalar_type(), output_dtype) << "output dtype";
  step.loss = torch::mse_loss(out.to(at::kFloat), testing::local_batch(step.y, rank, ranks));
  step.loss.backward();
  return step;
}

// --- L1_06 -------------------------------------------------------------------------

HP_DIST_TEST(FullyShardPrecision, L1_06_IgnoredParams, 2) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  auto [reference, model] = testing::build_from_seed<Mlp>(42, kIn, kDim, kHidden, kOut, kBlocks);

  const at::Tensor ignored = model->head->weight;
  FullyShardOptions root_options;
  root_options.ignored_params = {ignored};
  testing::ShardedParts parts = shard_model(model, {}, root_options);

  // Left exactly as it was: whole, same values, and no module manages it.
  EXPECT_EQ(ignored.sizes(), reference->head->weight.sizes());
  EXPECT_EQ(ignored.numel(), kOut * kDim);
  EXPECT_TRUE(ignored.equal(reference->head->weight));
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      EXPECT_NE(prefix + info.name, "head.weight") << "ignored parameter is managed";
    }
  }

  torch::manual_seed(7);
  at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});

  // What each rank's unsynchronised gradient must be: the reference gradient of that
  // rank's own batch alone.
  std::vector<at::Tensor> local_ref_grad;
  for (int64_t r = 0; r < ranks; ++r) {
    reference->zero_grad();
    torch::mse_loss(reference(testing::local_batch(x, r, ranks)), testing::local_batch(y, r, ranks))
        .backward();
    local_ref_grad.push_back(reference->head->weight.grad().clone());
  }
  // The data must make the ranks' gradients differ, or "not synchronised" is untested.
  ASSERT_GT(max_abs_diff(local_ref_grad[0], local_ref_grad[1]), 1e-3);

  reference->zero_grad();
  const testing::StepLosses losses =
      testing::backward_on_global_batch(reference, model, x, y, testing::mse_loss);
  EXPECT_NEAR(mean_over_ranks(losses.local), losses.reference.item<double>(), kTol) << "loss";

  // Still whole after forward and backward (never swapped for a shard).
  EXPECT_EQ(ignored.sizes(), reference->head->weight.sizes());
  ASSERT_TRUE(ignored.grad().defined());
  EXPECT_EQ(ignored.grad().sizes(), ignored.sizes());
  EXPECT_LE(max_abs_diff(ignored.grad(), local_ref_grad[rank]), kTol)
      << "ignored grad is not this rank's local gradient";

  // The ranks really hold different gradients (nothing averaged them).
  at::Tensor all = at::empty({ranks * ignored.numel()});
  all_gather(all, ignored.grad().contiguous().view(-1), *world->world_group()).wait();
  at::Tensor by_rank = all.view({ranks, ignored.numel()});
  EXPECT_GT(max_abs_diff(by_rank[0], by_rank[1]), 1e-3) << "ignored grad was synchronised";

  // Every other parameter is synchronised as usual.
  auto grads = testing::full_grads(parts);
  auto ref_grads = testing::reference_grads(*reference);
  EXPECT_EQ(grads.count("head.weight"), 0u);
  ref_grads.erase("head.weight");
  EXPECT_EQ(grads.size(), ref_grads.size());
  testing::expect_all_close(grads, ref_grads, kTol, "grad");
}

// --- L1_07 -------------------------------------------------------------------------

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void run_custom_placement() {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  auto [reference, model] = testing::build_from_seed<Mlp>(42, kIn, kDim, kHidden, kOut, kBlocks);

  FullyShardOptions options;
  options.shard_placement_fn = [](const std::string& name,
                                  const at::Tensor&) -> std::optional<Placement> {
    if (ends_with(name, "weight")) return Placement::shard(1);
    if (ends_with(name, "bias")) return Placement::replicate();
    return std::nullopt;
  };
  testing::ShardedParts parts = shard_model(model, options, options);

  auto params = model->named_parameters();
  auto ref_params = reference->named_parameters();
  std::set<std::string> seen;
  bool uneven = false;
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      const std::string name = prefix + info.name;
      SCOPED_TRACE(name);
      seen.insert(name);
      const at::Tensor& local = params[name];
      const std::vector<int64_t> full = ref_params[name].sizes().vec();
      EXPECT_EQ(info.global_shape, full);
      if (ends_with(name, "bias")) {
        EXPECT_EQ(info.placement, Placement::replicate());
        EXPECT_EQ(local.sizes().vec(), full);
        continue;
      }
      EXPECT_EQ(info.placement, Placement::shard(1));
      // Chunks of ceil(n / ranks) columns; the last rank holds the remainder.
      const int64_t chunk = (full[1] + ranks - 1) / ranks;
      const int64_t expected = std::clamp<int64_t>(full[1] - rank * chunk, 0, chunk);
      uneven = uneven || full[1] % ranks != 0;
      ASSERT_EQ(local.dim(), 2);
      EXPECT_EQ(local.size(0), full[0]) << "dim 0 must stay whole under Shard(1)";
      EXPECT_EQ(local.size(1), expected);
      EXPECT_EQ(info.local_shape, local.sizes().vec());
      // The shard holds exactly this rank's columns.
      if (expected > 0) {
        EXPECT_TRUE(local.equal(ref_params[name].narrow(1, rank * chunk, expected)));
      }
    }
  }
  EXPECT_TRUE(uneven) << "the model should have a weight whose dim 1 does not divide evenly";
  EXPECT_EQ(seen.size(), ref_params.size()) << "every parameter is sharded or replicated";

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
    ref_opt.zero_grad();
    // The optimizer's zero_grad (set_to_none) is the ordinary way to clear gradients
    // between steps; the replicated biases must honour it like the sharded weights.
    opt.zero_grad();
    const testing::StepLosses losses =
        testing::backward_on_global_batch(reference, model, x, y, testing::mse_loss);
    EXPECT_NEAR(mean_over_ranks(losses.local), losses.reference.item<double>(), kTol) << "loss";
    testing::expect_all_close(testing::full_grads(parts), testing::reference_grads(*reference),
                              kTol, "grad");

    ref_opt.step();
    opt.step();
    testing::expect_all_close(testing::full_params(parts), testing::reference_params(*reference),
                              kTol, "param after step");
  }
  // Replicated biases stay whole (and identical to the reference) through the steps.
  for (const auto& item : model->named_parameters()) {
    if (ends_with(item.key(), "bias")) {
      EXPECT_EQ(item.value().sizes(), ref_params[item.key()].sizes()) << item.key();
    }
  }
}

// 2 ranks: 5, 7, 9 columns split 3+2, 4+3, 5+4. 3 ranks: 2+2+1, 3+3+1, 3+3+3.
HP_DIST_TEST(FullyShardPrecision, L1_07_CustomShardPlacementFn, 2, 3) { run_custom_placement(); }

// --- L1_08 -------------------------------------------------------------------------

HP_DIST_TEST(FullyShardPrecision, L1_08_CommFusionNumericalEquivalence, 2) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  torch::manual_seed(42);
  Sharded<Mlp> fused(kIn, kDim, kHidden, kOut, kBlocks);
  torch::manual_seed(42);
  Sharded<Mlp> unfused(kIn, kDim, kHidden, kOut, kBlocks);

  FullyShardOptions on;
  on.comm_fusion = true;
  testing::ShardedParts parts_on = shard_model(fused, on, on);
  testing::ShardedParts parts_off = shard_model(unfused, {}, {});

  torch::optim::AdamW opt_on(fused->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt_off(unfused->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor x = testing::local_batch(torch::randn({kBatch, kIn}), rank, ranks);
    at::Tensor y = testing::local_batch(torch::randn({kBatch, kOut}), rank, ranks);
    opt_on.zero_grad();
    opt_off.zero_grad();
    at::Tensor loss_on = torch::mse_loss(fused(x), y);
    at::Tensor loss_off = torch::mse_loss(unfused(x), y);
    loss_on.backward();
    loss_off.backward();

    EXPECT_LT(std::abs(loss_on.item<double>() - loss_off.item<double>()), 1e-6) << "local loss";
    EXPECT_LT(std::abs(mean_over_ranks(loss_on) - mean_over_ranks(loss_off)), 1e-6) << "loss";
    // This rank's sharded gradients, and the gathered whole ones.
    auto local_on = cloned_grads(*fused), local_off = cloned_grads(*unfused);
    testing::expect_all_close(local_on, local_off, 1e-6, "sharded grad");
    testing::expect_all_close(testing::full_grads(parts_on), testing::full_grads(parts_off), 1e-6,
                              "grad");

    opt_on.step();
    opt_off.step();
    testing::expect_all_close(testing::full_params(parts_on), testing::full_params(parts_off), 1e-6,
                              "param after step");
  }
}

// --- L1_10 -------------------------------------------------------------------------

// bf16 compute with an fp32 reduce; `replicate` set: the blocks' fc1.weight
// (shard_placement_fn) and the root's input.weight (replicate_params) are replicated,
// and the policy must hold for them as for the sharded ones.
void run_bf16_param_fp32_reduce(bool replicate) {
  const int64_t ranks = testing::world()->size();
  auto [reference, model] = testing::build_from_seed<RecordingMlp>(42);
  reference->to(at::kBFloat16);

  FullyShardOptions block_options;
  block_options.mp_policy.param_dtype = at::kBFloat16;
  block_options.mp_policy.reduce_dtype = at::kFloat;
  // output_dtype only on the root: a block emitting fp32 would feed fp32 activations to
  // the root's own bf16 head (the root's cast_forward_inputs covers only its input).
  FullyShardOptions root_options = block_options;
  root_options.mp_policy.output_dtype = at::kFloat;
  if (replicate) {
    block_options.shard_placement_fn = [](const std::string& name, const at::Tensor&) {
      return name == "fc1.weight" ? std::optional<Placement>(Placement::replicate()) : std::nullopt;
    };
    root_options.replicate_params = {model->input->weight};
  }
  testing::ShardedParts parts = shard_model(model, block_options, root_options);
  if (replicate) {
    for (auto& block : model->blocks) {
      for (const ShardedParamInfo& info : block.fsdp().sharded_params()) {
        EXPECT_EQ(info.placement.is_replicate(), info.name == "fc1.weight") << info.name;
      }
    }
  }
  const Bf16Step step = bf16_backward(reference, model, /*output_dtype=*/at::kFloat);
  // Inside forward every module computed with bf16 weights on bf16 inputs.
  std::vector<c10::ScalarType> weights = model->weight_dtypes, inputs = model->input_dtypes;
  for (auto& block : model->blocks) {
    weights.insert(weights.end(), block->weight_dtypes.begin(), block->weight_dtypes.end());
    inputs.insert(inputs.end(), block->input_dtypes.begin(), block->input_dtypes.end());
  }
  ASSERT_EQ(weights.size(), static_cast<size_t>(kBlocks + 1));
  for (c10::ScalarType dtype : weights) EXPECT_EQ(dtype, at::kBFloat16) << "unsharded param";
  for (c10::ScalarType dtype : inputs) EXPECT_EQ(dtype, at::kBFloat16) << "forward input";

  // Sharded parameters and their gradients are back in the original fp32.
  ASSERT_NO_FATAL_FAILURE(expect_param_and_grad_dtypes(model, at::kFloat, at::kFloat));

  // Against the single-process bf16 run on the global batch. The grad norms differ by
  // ~7e-4 here (loss by ~6e-8): the reference rounds each weight gradient, a sum over
  // all 12 samples, to bf16 once, while FSDP rounds each rank's 6-sample partial sum to
  // bf16 and averages those in fp32. Same math, different bf16 rounding points.
  auto grads = testing::full_grads(parts);
  EXPECT_NEAR(mean_over_ranks(step.loss), step.ref_loss.item<double>(), 1e-3) << "loss";
  EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(testing::reference_grads(*reference)), 1e-3)
      << "global grad norm";

  // So the element-wise check uses a reference rounded where FSDP rounds: each rank's
  // local batch through a plain bf16 copy, its bf16 grads cast to fp32 and averaged in
  // fp32. FSDP must match it to fp32 accuracy; reducing in bf16 instead (reduce_dtype
  // ignored) rounds the average to bf16 and misses by 2e-4 .. 1e-3 here.
  torch::manual_seed(42);
  RecordingMlp per_rank;
  per_rank->to(at::kBFloat16);
  testing::expect_all_close(
      grads, mean_of_local_fp32_grads(per_rank, step.x, step.y, ranks, at::kBFloat16), kTol,
      "grad vs per-rank bf16 reference");
}

HP_DIST_TEST(FullyShardPrecision, L1_10_MpBf16ParamFp32Reduce, 2) {
  run_bf16_param_fp32_reduce(/*replicate=*/false);
}

HP_DIST_TEST(FullyShardPrecision, MpPolicyHoldsForReplicatedParams, 2) {
  run_bf16_param_fp32_reduce(/*replicate=*/true);
}

// --- L1_11 -------------------------------------------------------------------------

HP_DIST_TEST(FullyShardPrecision, L1_11_MpAllBf16, 2) {
  auto [reference, model] = testing::build_from_seed<RecordingMlp>(42);
  reference->to(at::kBFloat16);
  model->to(at::kBFloat16);

  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kBFloat16;
  options.mp_policy.reduce_dtype = at::kBFloat16;
  options.mp_policy.output_dtype = at::kBFloat16;
  shard_model(model, options, options);
  const Bf16Step step = bf16_backward(reference, model, /*output_dtype=*/at::kBFloat16);

  ASSERT_NO_FATAL_FAILURE(expect_param_and_grad_dtypes(model, at::kBFloat16, at::kBFloat16));
  EXPECT_NEAR(mean_over_ranks(step.loss), step.ref_loss.item<double>(), 1e-3) << "loss";
  for (c10::ScalarType dtype : model->weight_dtypes) EXPECT_EQ(dtype, at::kBFloat16);
}

// --- L1_12 -------------------------------------------------------------------------

// Records the dtype of the input it receives, then casts it to its weights' dtype
// itself: correct whether or not fully_shard cast the input first.
struct CastingNetImpl : torch::nn::Module {
  CastingNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kIn, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kOut))) {}
  at::Tensor forward(const at::Tensor& x) {
    input_dtypes.push_back(x.scalar_type());
    weight_dtypes.push_back(fc1->weight.scalar_type());
    return fc2(torch::tanh(fc1(x.to(fc1->weight.scalar_type()))));
  }
  torch::nn::Linear fc1, fc2;
  std::vector<c10::ScalarType> input_dtypes, weight_dtypes;
};
TORCH_MODULE(CastingNet);

struct CastRun {
  c10::ScalarType input_dtype = c10::ScalarType::Undefined;
  c10::ScalarType weight_dtype = c10::ScalarType::Undefined;
  double loss = NAN;
};

CastRun run_cast_forward_inputs(bool cast) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  torch::manual_seed(42);
  Sharded<CastingNet> model;
  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kHalf;
  options.mp_policy.reduce_dtype = at::kFloat;
  options.mp_policy.cast_forward_inputs = cast;
  fully_shard(model, options);

  torch::manual_seed(7);
  at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  at::Tensor out = model(testing::local_batch(x, rank, ranks));
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  at::Tensor loss = torch::mse_loss(out.to(at::kFloat), testing::local_batch(y, rank, ranks));
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
    if (!item.value().grad().defined()) continue;
    EXPECT_EQ(item.value().grad().scalar_type(), at::kFloat) << item.key();
    EXPECT_TRUE(item.value().grad().isfinite().all().item<bool>()) << item.key();
  }
  EXPECT_EQ(model->input_dtypes.size(), 1u);
  EXPECT_EQ(model->weight_dtypes.size(), 1u);
  if (model->input_dtypes.empty() || model->weight_dtypes.empty()) return {};
  return {model->input_dtypes.front(), model->weight_dtypes.front(), mean_over_ranks(loss)};
}

HP_DIST_TEST(FullyShardPrecision, L1_12_MpCastForwardInputsFalse, 2) {
  const CastRun uncast = run_cast_forward_inputs(false);
  EXPECT_EQ(uncast.input_dtype, at::kFloat) << "the caller's dtype must reach forward";
  EXPECT_EQ(uncast.weight_dtype, at::kHalf);
  // Control: the same module with the cast on sees param_dtype.
  const CastRun cast = run_cast_forward_inputs(true);
  EXPECT_EQ(cast.input_dtype, at::kHalf);
  EXPECT_EQ(cast.weight_dtype, at::kHalf);
  // The module's own cast is the same cast fully_shard would have made.
  EXPECT_EQ(uncast.loss, cast.loss);
}

// --- L1_13 -------------------------------------------------------------------------

// `replicate`: the blocks' fc1.weight replicated (shard_placement_fn); the main grad must
// hold for them as for the sharded ones.
void run_fp32_main_grad(bool replicate) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  auto [reference, model] = testing::build_from_seed<Mlp>(42, kIn, kDim, kHidden, kOut, kBlocks);
  reference->to(at::kHalf);
  model->to(at::kHalf);

  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kHalf;
  options.mp_policy.reduce_dtype = at::kFloat;
  options.mp_policy.apply_grad_on_fp32_main_grad = true;
  if (replicate) {
    options.shard_placement_fn = [](const std::string& name, const at::Tensor&) {
      return name == "fc1.weight" ? std::optional<Placement>(Placement::replicate()) : std::nullopt;
    };
  }
  testing::ShardedParts parts = shard_model(model, options, options);

  torch::manual_seed(7);
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (int pass = 0; pass < 2; ++pass) {
    batches.emplace_back(torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut}));
  }

  // Independent reference: every rank's local batch through the plain fp16 model, its
  // fp16 gradients cast to fp32, averaged over ranks; cumulative over the passes.
  std::vector<std::map<std::string, at::Tensor>> expected;
  std::map<std::string, at::Tensor> sum;
  for (const auto& [x, y] : batches) {
    for (const auto& [name, g] : mean_of_local_fp32_grads(reference, x, y, ranks, at::kHalf)) {
      sum[name] = sum.count(name) ? sum[name] + g : g;
    }
    std::map<std::string, at::Tensor> snapshot;
    for (const auto& [name, g] : sum) snapshot[name] = g.clone();
    expected.push_back(snapshot);
  }

  auto params = model->named_parameters();
  std::map<std::string, at::Tensor> first_grad;  // param.grad after the first pass
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    const auto& [x, y] = batches[pass];
    // No zero_grad between the passes: the second accumulates into the first.
    torch::mse_loss(model(testing::local_batch(x, rank, ranks)).to(at::kFloat),
                    testing::local_batch(y, rank, ranks))
        .backward();
    for (const auto& [prefix, module] : parts) {
      for (const auto& info : module.sharded_params()) {
        const std::string name = prefix + info.name;
        const at::Tensor& param = params[name];
        EXPECT_EQ(param.scalar_type(), at::kHalf) << name;
        const at::Tensor grad = param.grad();
        ASSERT_TRUE(grad.defined()) << name;
        EXPECT_EQ(grad.scalar_type(), at::kFloat) << name;
        EXPECT_TRUE(grad.is_same(module.main_grad(info.name))) << name << ": grad is not main_grad";
        if (pass == 0) {
          first_grad[name] = grad;
        } else {
          EXPECT_TRUE(grad.is_same(first_grad[name])) << name << ": not accumulated in place";
        }
      }
    }
    testing::expect_all_close(testing::full_grads(parts), expected[pass], kTol, "main grad");
  }

  parts.back().second.zero_grad();  // the root's, recursing into the blocks
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      EXPECT_FALSE(params[prefix + info.name].grad().defined()) << prefix + info.name;
      EXPECT_FALSE(module.main_grad(info.name).defined()) << prefix + info.name;
    }
  }
}

HP_DIST_TEST(FullyShardPrecision, L1_13_MpApplyGradOnFp32MainGrad, 2) {
  run_fp32_main_grad(/*replicate=*/false);
}

HP_DIST_TEST(FullyShardPrecision, Fp32MainGradHoldsForReplicatedParams, 2) {
  run_fp32_main_grad(/*replicate=*/true);
}

// --- fp16 gradient reduction --------------------------------------------------------

// Two ranks whose fp16 gradients are 40000 each: their sum (80000) is past fp16's largest
// value (65504). Averaged, the gradient is 40000, which fp16 holds: half is divided
// before the reduction and the rest after, so the sum never leaves fp16's range.
HP_DIST_TEST(FullyShardPrecision, Fp16GradientsAveragedOverRanksDoNotOverflowTheSum, 2) {
  Sharded<torch::nn::Linear> layer(torch::nn::LinearOptions(4, 4).bias(false));
  torch::nn::init::zeros_(layer->weight);
  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kHalf;
  options.mp_policy.reduce_dtype = at::kHalf;
  FSDPModule module = fully_shard(layer, options);
  layer(torch::full({1, 4}, 40000.0)).sum().backward();
  const at::Tensor grad = module.full_grad("weight");
  EXPECT_TRUE(torch::equal(grad, torch::full({4, 4}, 40000.0, grad.options())))
      << "the averaged gradient: " << grad;
}

}  // namespace
}  // namespace hp
