// Real-network cases of the test plan with a Vision Transformer (models/vit.h), each
// against the single-process run of the same model class on the global batch, over two
// AdamW steps:
//   L3-04 ViT (hidden 256, 224x224 images, 6 blocks), 1-D FSDP on 2 ranks with the patch
//         embedding and the head replicated:
//         FullyShardWithVit.L3_04_VitFsdp1DVsSingleProcess
//   L3-06 ViT -> projection MLP -> decoder (models/multimodal.h), the two sub-models
//         fully_shard-ed separately, the projection replicated:
//         FullyShardWithVit.L3_06_MultimodalDeepStackFsdp
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "models/multimodal.h"
#include "models/vit.h"

namespace hp {
namespace {

using models::MultimodalConfig;
using models::VisionLanguageModel;
using models::VisionTransformer;
using models::VitConfig;

constexpr double kTol = 1e-5;

// The entries of `tensors` whose names start with `prefix`.
std::map<std::string, at::Tensor> with_prefix(const std::map<std::string, at::Tensor>& tensors,
                                              const std::string& prefix) {
  std::map<std::string, at::Tensor> selected;
  for (const auto& [name, t] : tensors) {
    if (name.starts_with(prefix)) selected.emplace(name, t);
  }
  return selected;
}

// Whether this rank's `tensor` has the same bits on every rank.
bool bitwise_same_on_all_ranks(const at::Tensor& tensor) {
  const Group& group = *testing::world()->world_group();
  at::Tensor all = torch::empty({group.size(), tensor.numel()}, tensor.options());
  all_gather(all, tensor.detach().contiguous().view(-1), group).wait();
  for (int64_t r = 1; r < group.size(); ++r) {
    if (!torch::equal(all[r], all[0])) return false;
  }
  return true;
}

// Replicate() exactly for the parameters whose names start with one of `replicated`.
void expect_placements(const FSDPModule& module, const std::vector<std::string>& replicated) {
  for (const auto& info : module.sharded_params()) {
    bool whole = false;
    for (const auto& prefix : replicated) whole = whole || info.name.starts_with(prefix);
    EXPECT_EQ(info.placement.is_replicate(), whole) << info.name << " " << info.placement.str();
    if (whole) {
      EXPECT_EQ(info.local_shape, info.global_shape) << info.name;
    }
  }
}

// The plan's L3-04 model: hidden 256, 224x224 images in 16x16 patches (196 + CLS
// tokens), 6 blocks; 4 heads, MLP 2x (4x doubles the CPU time) and 10 classes are ours.
VitConfig l3_04_config() {
  return {.image_size = 224,
          .patch_size = 16,
          .channels = 3,
          .dim = 256,
          .heads = 4,
          .layers = 6,
          .mlp_hidden = 512,
          .num_classes = 10};
}

HP_DIST_TEST(FullyShardWithVit, L3_04_VitFsdp1DVsSingleProcess, 2) {
  auto world = testing::world();
  const VitConfig config = l3_04_config();
  auto [reference, model] = testing::build_from_seed<VisionTransformer>(42, config);
  // Patch embedding and head stay whole on every rank; the rest of the root is Shard(0).
  FullyShardOptions root_options;
  for (const auto& p : model->patch_embed->parameters()) root_options.replicate_params.push_back(p);
  for (const auto& p : model->head->parameters()) root_options.replicate_params.push_back(p);
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", {}, root_options);
  expect_placements(parts.back().second, {"patch_embed.", "head."});

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Global batch: one image per rank.
    at::Tensor images =
        torch::randn({world->size(), config.channels, config.image_size, config.image_size});
    at::Tensor labels = torch::randint(config.num_classes, {world->size()});
    opt.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(
        model(testing::local_batch(images, world->rank(), world->size())),
        testing::local_batch(labels, world->rank(), world->size()));
    loss.backward();
    ref_opt.zero_grad();
    at::Tensor ref_loss = torch::nn::functional::cross_entropy(reference(images), labels);
    ref_loss.backward();

    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_NEAR(testing::mean_over_ranks(loss).item<double>(), ref_loss.item<double>(), kTol)
        << "loss";
    EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(ref_grads), kTol) << "grad norm";
    // The replicated patch-embedding gradient: the same bits on every rank, and the
    // reference's (checked below with all the others).
    for (const auto& p : model->patch_embed->parameters()) {
      EXPECT_TRUE(bitwise_same_on_all_ranks(p.grad())) << "patch embedding grad differs by rank";
    }
    // The plan names the patch embedding and the last block's MLP weights; every
    // gradient is checked.
    EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters managed by fully_shard";
    testing::expect_all_close(grads, ref_grads, kTol, "grad");
    opt.step();
    ref_opt.step();
    // The next step starts the reference from the sharded model's parameters. AdamW's
    // first step moves a parameter by up to lr whatever its gradient's size, so gradients
    // at rounding level (|g| ~ 1e-9, summed in another order on one process) leave
    // parameters up to 1e-4 apart (measured on AVX-512 machines): the next gradients
    // would compare two different models.
    torch::NoGradGuard no_grad;
    const auto params = testing::full_params(parts);
    for (auto& item : reference->named_parameters()) item.value().copy_(params.at(item.key()));
  }
}

// The plan's L3-06 model: a 4-block ViT of hidden 128 (224x224 images, 197 tokens), a
// projection 128 -> 256 -> 256, a 2-block decoder of hidden 256 over the image tokens
// and 32 text tokens.
MultimodalConfig l3_06_config() {
  return {
      .vision = {.image_size = 224,
                 .patch_size = 16,
                 .channels = 3,
                 .dim = 128,
                 .heads = 4,
                 .layers = 4,
                 .mlp_hidden = 512,
                 .num_classes = 0},
      .text = {
          .vocab = 1024, .dim = 256, .heads = 4, .layers = 2, .ffn_hidden = 688, .max_seq = 32}};
}

HP_DIST_TEST(FullyShardWithVit, L3_06_MultimodalDeepStackFsdp, 2) {
  auto world = testing::world();
  const MultimodalConfig config = l3_06_config();
  auto [reference, model] = testing::build_from_seed<VisionLanguageModel>(42, config);
  // Each sub-model block by block, then the sub-model; the root last, owning only the
  // projection, which it keeps whole on every rank.
  testing::ShardedParts parts;
  for (size_t i = 0; i < model->vision->blocks.size(); ++i) {
    parts.emplace_back("vision.blocks." + std::to_string(i) + ".",
                       fully_shard(model->vision->blocks[i]));
  }
  parts.emplace_back("vision.", fully_shard(model->vision));
  for (size_t i = 0; i < model->decoder->layers.size(); ++i) {
    parts.emplace_back("decoder.layers." + std::to_string(i) + ".",
                       fully_shard(model->decoder->layers[i]));
  }
  parts.emplace_back("decoder.", fully_shard(model->decoder));
  FullyShardOptions root_options;
  root_options.replicate_params = model->projector->parameters();
  parts.emplace_back("", fully_shard(model, root_options));
  expect_placements(parts.back().second, {"projector."});
  expect_placements(parts[parts.size() - 2].second, {});  // the decoder: all sharded

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  const VitConfig& vision = config.vision;
  const int64_t seq = config.text.max_seq;
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Global batch: one image and its caption per rank.
    at::Tensor images =
        torch::randn({world->size(), vision.channels, vision.image_size, vision.image_size});
    at::Tensor tokens = torch::randint(config.text.vocab, {world->size(), seq + 1});
    at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);
    auto local = [&](const at::Tensor& t) {
      return testing::local_batch(t, world->rank(), world->size());
    };
    opt.zero_grad();
    at::Tensor loss =
        testing::token_cross_entropy(model(local(images), local(input)), local(target));
    loss.backward();
    ref_opt.zero_grad();
    at::Tensor ref_loss = testing::token_cross_entropy(reference(images, input), target);
    ref_loss.backward();

    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_NEAR(testing::mean_over_ranks(loss).item<double>(), ref_loss.item<double>(), kTol)
        << "end-to-end loss";
    const double vit_norm = testing::norm_of(with_prefix(grads, "vision."));
    EXPECT_NEAR(vit_norm, testing::norm_of(with_prefix(ref_grads, "vision.")), kTol)
        << "ViT grad norm";
    EXPECT_NEAR(testing::norm_of(with_prefix(grads, "decoder.")),
                testing::norm_of(with_prefix(ref_grads, "decoder.")), kTol)
        << "decoder grad norm";
    testing::expect_all_close(with_prefix(grads, "projector."),
                              with_prefix(ref_grads, "projector."), kTol, "projection grad");
    // Gradients cross both module boundaries: the projection's come from the decoder's
    // input, the ViT's only through the projection.
    for (const auto& p : model->projector->parameters()) {
      EXPECT_GT(p.grad().abs().max().item<double>(), 0.0) << "projection grad is zero";
    }
    EXPECT_GT(vit_norm, 0.0) << "no gradient reached the ViT";
    EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters managed by fully_shard";
    testing::expect_all_close(grads, ref_grads, kTol, "grad");
    opt.step();
    ref_opt.step();
  }
}

}  // namespace
}  // namespace hp
