// fully_shard on the decoder-only transformer (models/transformer.h) against the
// single-process reference of the same class on the global batch: fp32, two AdamW
// steps, loss, global grad norm, every gradient and every parameter within 1e-5. The
// output projection is tied to the token embedding, which the root manages once.
// 1-D FSDP on 2 ranks and 2x2 HSDP on 4 ranks.
#include <torch/torch.h>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

constexpr double kTol = 1e-5;

TransformerConfig tiny_config() {
  TransformerConfig config;
  config.vocab = 32;
  config.dim = 16;
  config.heads = 2;
  config.layers = 2;
  config.ffn_hidden = 25;  // odd: w1, w3 and w2 shards are padded
  config.max_seq = 8;
  return config;
}

void run_parity(const std::optional<DeviceMesh>& mesh) {
  auto world = testing::world();
  const int64_t ranks = world->size(), rank = world->rank();
  torch::manual_seed(42);
  Transformer reference(tiny_config());
  torch::manual_seed(42);
  Sharded<Transformer> model(tiny_config());

  FullyShardOptions options;
  options.mesh = mesh;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);

  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(32, {8, 9}, torch::kLong);  // 8: divisible by 2 and 4
    at::Tensor input = tokens.narrow(1, 0, 8), target = tokens.narrow(1, 1, 8);
    auto loss_of = [](const at::Tensor& logits, const at::Tensor& target) {
      return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                  target.reshape(-1));
    };
    ref_opt.zero_grad();
    at::Tensor ref_loss = loss_of(reference(input), target);
    ref_loss.backward();

    opt.zero_grad();
    at::Tensor loss = loss_of(model(testing::local_batch(input, rank, ranks)),
                              testing::local_batch(target, rank, ranks));
    loss.backward();

    at::Tensor mean_loss = loss.detach().clone();
    all_reduce(mean_loss, ReduceOp::kAvg, *world->world_group()).wait();
    EXPECT_NEAR(mean_loss.item<double>(), ref_loss.item<double>(), kTol) << "loss";
    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_EQ(grads.size(), ref_grads.size()) << "parameters managed by fully_shard";
    EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(ref_grads), kTol) << "grad norm";
    testing::expect_all_close(grads, ref_grads, kTol, "grad");

    ref_opt.step();
    opt.step();
    testing::expect_all_close(testing::full_params(parts), testing::reference_params(*reference),
                              kTol, "param after step");
  }
}

HP_DIST_TEST(TransformerParity, Fsdp1D, 2) { run_parity(std::nullopt); }

HP_DIST_TEST(TransformerParity, Hsdp2x2, 4) {
  run_parity(DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}}));
}

}  // namespace
}  // namespace hp
