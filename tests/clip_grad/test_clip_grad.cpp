// L2-07: clipping the gradients of a fully_shard-ed model by their global norm, against
// torch::nn::utils::clip_grad_norm_ on the same model in one process with the global
// batch: the norm, and every clipped gradient, within 1e-5; the clipped norm is at most
// max_norm. 1-D FSDP (even and uneven shards), 2x2 HSDP with a replicated parameter,
// the infinity norm, fp32 main grads.
#include <torch/torch.h>

#include <limits>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/clip_grad.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

constexpr double kTol = 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  std::optional<DeviceMesh> mesh;
  double norm_type = 2.0;
  bool replicate_head_bias = false;
  bool on_device = false;  // clip_grad_norm_on_device_
};

double clip(const Case& c, const std::vector<at::Tensor>& params, double max_norm) {
  if (!c.on_device) return clip_grad_norm_(params, max_norm, c.norm_type);
  const at::Tensor norm = clip_grad_norm_on_device_(params, max_norm, c.norm_type);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.scalar_type(), at::kDouble);
  return norm.item<double>();
}

double max_abs(const std::map<std::string, at::Tensor>& tensors) {
  double result = 0;
  for (const auto& [name, t] : tensors) result = std::max(result, t.abs().max().item<double>());
  return result;
}

double norm_of(const std::map<std::string, at::Tensor>& grads, double norm_type) {
  return norm_type == kInf ? max_abs(grads) : testing::norm_of(grads);
}

void expect_clipping_matches_reference(const Case& c) {
  auto [reference, model] = testing::build_from_seed<Mlp>(42, 5, 7, 9, 3, 3);
  FullyShardOptions block_options;
  block_options.mesh = c.mesh;
  FullyShardOptions root_options = block_options;
  if (c.replicate_head_bias) root_options.replicate_params = {model->head->bias};
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", block_options, root_options);

  torch::manual_seed(7);
  const at::Tensor x = torch::randn({12, 5}), y = torch::randn({12, 3});
  testing::backward_on_global_batch(reference, model, x, y, testing::mse_loss);

  // Half the norm: clipping must scale every gradient.
  const double max_norm = 0.5 * norm_of(testing::reference_grads(*reference), c.norm_type);
  const double ref_norm =
      torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm, c.norm_type);
  const double norm = clip(c, model->parameters(), max_norm);
  EXPECT_NEAR(norm, ref_norm, kTol) << "norm before clipping";

  const auto grads = testing::full_grads(parts);
  testing::expect_all_close(grads, testing::reference_grads(*reference), kTol, "clipped grad");
  EXPECT_LE(norm_of(grads, c.norm_type), max_norm) << "norm after clipping";

  // Already within the limit: the norm is reported, nothing changes.
  const double again = clip(c, model->parameters(), 2 * max_norm);
  EXPECT_NEAR(again, max_norm, kTol);
  testing::expect_all_close(testing::full_grads(parts), grads, 0.0, "grad within the limit");
}

HP_DIST_TEST(ClipGrad, L2_07_GlobalNormFsdp1D, 2, 3) { expect_clipping_matches_reference({}); }

HP_DIST_TEST(ClipGrad, L2_07_GlobalNormHsdp2x2WithReplicatedParam, 4) {
  expect_clipping_matches_reference(
      {DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}), 2.0, true});
}

// The same without reading the norm on the host.
HP_DIST_TEST(ClipGrad, OnDeviceFormClipsTheSame, 2) {
  expect_clipping_matches_reference({.on_device = true});
  expect_clipping_matches_reference({.norm_type = kInf, .on_device = true});
}

HP_DIST_TEST(ClipGrad, L2_07_InfinityNorm, 2) {
  expect_clipping_matches_reference({std::nullopt, kInf});
}

// apply_grad_on_fp32_main_grad: the fp32 main grad is what the optimizer reads, so it is
// what is measured and scaled.
HP_DIST_TEST(ClipGrad, ScalesTheFp32MainGrad, 2) {
  auto [reference, model] = testing::build_from_seed<Mlp>(42, 5, 7, 9, 3, 3);
  model->to(at::kHalf);
  FullyShardOptions options;
  options.mp_policy.param_dtype = at::kHalf;
  options.mp_policy.reduce_dtype = at::kFloat;
  options.mp_policy.apply_grad_on_fp32_main_grad = true;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  torch::manual_seed(7);
  const auto world = testing::world();
  const at::Tensor x = testing::local_batch(torch::randn({12, 5}), world->rank(), world->size());
  model(x.to(at::kHalf)).to(at::kFloat).pow(2).mean().backward();

  const auto before = testing::full_grads(parts);  // the main grads, gathered
  const double max_norm = 0.5 * testing::norm_of(before);
  const double norm = clip_grad_norm_(model->parameters(), max_norm);
  EXPECT_NEAR(norm, testing::norm_of(before), kTol);
  std::map<std::string, at::Tensor> expected;
  for (const auto& [name, grad] : before) expected[name] = grad * (max_norm / (norm + 1e-6));
  testing::expect_all_close(testing::full_grads(parts), expected, kTol, "clipped main grad");
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      EXPECT_EQ(module.main_grad(info.name).scalar_type(), at::kFloat) << prefix + info.name;
    }
  }
}

HP_DIST_TEST(ClipGrad, BadArgumentsAndNonFiniteNorm, 2) {
  Sharded<torch::nn::Linear> layer(torch::nn::LinearOptions(4, 4));
  fully_shard(layer, {});
  layer(torch::ones({2, 4})).sum().backward();
  const std::vector<at::Tensor> params = layer->parameters();
  EXPECT_THROW(clip_grad_norm_(params, 0.0), c10::ValueError);
  EXPECT_THROW(clip_grad_norm_(params, 1.0, -1.0), c10::ValueError);
  layer->weight.mutable_grad().fill_(std::numeric_limits<float>::quiet_NaN());
  try {
    clip_grad_norm_(params, 1.0, 2.0, /*error_if_nonfinite=*/true);
    ADD_FAILURE() << "a NaN norm was not reported";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("error_if_nonfinite"), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace hp
