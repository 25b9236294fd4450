// Real-network cases of the test plan on the decoder-only transformer
// (models/transformer.h: RMSNorm, attention, SwiGLU, tied embedding): L3-01 (2x2 HSDP),
// L3-02 (1-D FSDP) against the single-process run of the same model on the global
// batch, both with a bitwise rerun; and L2-08 (changing sequence length).
#include <torch/torch.h>

#include <cstring>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

// The plan's L3-01 model: 4 layers, vocab 1024, hidden 256, sequence 128.
TransformerConfig l3_config() {
  return {.vocab = 1024, .dim = 256, .heads = 4, .layers = 4, .ffn_hidden = 688, .max_seq = 128};
}

using testing::StepResult;

// Two AdamW steps of the sharded model; with `reference` also the single-process run,
// compared on the way (loss, grad norm, every gradient within 1e-5).
std::vector<StepResult> train(const std::optional<DeviceMesh>& mesh, bool check_reference) {
  auto world = testing::world();
  const TransformerConfig config = l3_config();
  Transformer reference{nullptr};
  if (check_reference) {
    torch::manual_seed(42);
    reference = Transformer(config);
  }
  torch::manual_seed(42);
  Sharded<Transformer> model(config);
  FullyShardOptions options;
  options.mesh = mesh;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::optional<torch::optim::AdamW> ref_opt;
  if (check_reference) ref_opt.emplace(reference->parameters(), torch::optim::AdamWOptions(1e-3));

  std::vector<StepResult> results;
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(config.vocab, {world->size(), config.max_seq + 1});
    at::Tensor input = tokens.narrow(1, 0, config.max_seq);
    at::Tensor target = tokens.narrow(1, 1, config.max_seq);
    opt.zero_grad();
    at::Tensor loss = testing::token_cross_entropy(
        model(testing::local_batch(input, world->rank(), world->size())),
        testing::local_batch(target, world->rank(), world->size()));
    loss.backward();
    at::Tensor mean_loss = testing::mean_over_ranks(loss);
    auto grads = testing::full_grads(parts);
    results.push_back({mean_loss.item<float>(), static_cast<float>(testing::norm_of(grads))});
    if (check_reference) {
      // The plan names the first layer's attention and the last layer's FFN weights;
      // every gradient is checked.
      testing::expect_reference_step_matches(reference, input, target, mean_loss.item<double>(),
                                             grads, 1e-5);
      ref_opt->step();
    }
    opt.step();
  }
  return results;
}

HP_DIST_TEST_WITH_TIMEOUT(FullyShardWithLlm, L3_01_LlmDecoderHsdpVsDdp, 300, 4) {
  DeviceMesh mesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}});
  auto first = train(mesh, /*check_reference=*/true);
  testing::expect_bitwise_equal(first, train(mesh, /*check_reference=*/false));
}

HP_DIST_TEST_WITH_TIMEOUT(FullyShardWithLlm, L3_02_LlmDecoderFsdp1DVsDdp, 300, 2) {
  auto first = train(std::nullopt, /*check_reference=*/true);
  testing::expect_bitwise_equal(first, train(std::nullopt, /*check_reference=*/false));
}

// L2-08: five steps with different sequence lengths finish (the harness timeout is
// 60 s), losses and grad norms stay finite, parameter shapes do not change.
HP_DIST_TEST(FullyShardWithLlm, L2_08_DynamicSequenceLength, 2) {
  auto world = testing::world();
  const TransformerConfig config{
      .vocab = 64, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 40, .max_seq = 32};
  torch::manual_seed(1);
  Sharded<Transformer> model(config);
  std::vector<FSDPModule> blocks;
  for (auto& layer : model->layers) blocks.push_back(fully_shard(layer));
  FSDPModule root = fully_shard(model);
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : model->parameters()) shapes.push_back(p.sizes().vec());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  for (int64_t seq : {8, 32, 5, 17, 12}) {
    SCOPED_TRACE("seq " + std::to_string(seq));
    at::Tensor tokens = torch::randint(config.vocab, {4, seq + 1});
    opt.zero_grad();
    at::Tensor loss = testing::token_cross_entropy(
        model(testing::local_batch(tokens.narrow(1, 0, seq), world->rank(), 2)),
        testing::local_batch(tokens.narrow(1, 1, seq), world->rank(), 2));
    loss.backward();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    double squares = 0;
    for (const auto& p : model->parameters()) squares += p.grad().pow(2).sum().item<double>();
    EXPECT_TRUE(std::isfinite(squares));
    opt.step();
    size_t i = 0;
    for (const auto& p : model->parameters()) EXPECT_EQ(p.sizes().vec(), shapes[i++]);
  }
}

}  // namespace
}  // namespace hp
