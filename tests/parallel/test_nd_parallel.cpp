// Tensor x context parallelism with fully_shard on one 3-D mesh: the topology where seed
// 000 saw A/A runs diverge (TP 2 x CP 4, FSDP shard size 1, backward prefetch on, AdamW):
// 200 steps run twice give bitwise equal losses and grad norms at every step, and the
// first steps match the single-process model on the global batch.
#include <torch/torch.h>

#include <cstring>

#include "distributed_test.h"
#include "fsdp_test_util.h"
#include "hyperparallel/clip_grad.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/tensor_parallel.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

TransformerConfig seed_000_config() {
  return {.vocab = 64, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 64, .max_seq = 16};
}

using testing::StepResult;

// `steps` AdamW steps on {cp 4, dp_shard 1, tp 2}: fully_shard replicates over cp and
// shards over dp_shard (size 1), every rank sees the same batch (one data-parallel
// replica), cp splits its sequences (load-balanced), tp its heads, FFN and vocabulary.
// The first `reference_steps` are compared with the single-process model.
std::vector<StepResult> train(int steps, int reference_steps) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"cp", 4}, {"dp_shard", 1}, {"tp", 2}});
  TransformerConfig config = seed_000_config();
  Transformer reference{nullptr};
  if (reference_steps > 0) {
    torch::manual_seed(3);
    reference = Transformer(config);
  }
  config.tensor_parallel = mesh.group("tp");
  config.context_parallel = mesh.group("cp");
  torch::manual_seed(3);
  Sharded<Transformer> model(config);
  FullyShardOptions options;
  options.mesh = mesh.slice({"cp", "dp_shard"});  // replicate over cp, shard size 1
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);
  EXPECT_EQ(parts.back().second.sharded_params().front().mesh_dims,
            (std::vector<std::string>{"cp", "dp_shard"}));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::optional<torch::optim::AdamW> ref_opt;
  if (reference_steps > 0) {
    ref_opt.emplace(reference->parameters(), torch::optim::AdamWOptions(1e-3));
  }

  std::vector<StepResult> results;
  torch::manual_seed(11);
  const int64_t seq = config.max_seq;
  for (int step = 0; step < steps; ++step) {
    at::Tensor tokens = torch::randint(config.vocab, {2, seq + 1});
    at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);
    opt.zero_grad();
    at::Tensor logits = model(shard_sequence(input, config.context_parallel));
    at::Tensor loss = vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}),
        shard_sequence(target, config.context_parallel).reshape(-1), config.tensor_parallel);
    loss.backward();
    const double norm = clip_grad_norm_(model->parameters(), 1.0);
    results.push_back({testing::mean_over_ranks(loss).item<float>(), static_cast<float>(norm)});
    if (step < reference_steps) {
      SCOPED_TRACE("step " + std::to_string(step));
      auto grads = testing::full_grads(parts);
      ref_opt->zero_grad();
      at::Tensor ref_loss = testing::token_cross_entropy(reference(input), target);
      ref_loss.backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 1.0);
      EXPECT_NEAR(results.back().loss, ref_loss.item<double>(), 1e-5) << "loss";
      EXPECT_NEAR(norm, ref_norm, 1e-5) << "grad norm";
      testing::expect_all_close(grads, testing::reference_grads(*reference), 1e-5, "grad");
      ref_opt->step();
    }
    opt.step();
  }
  return results;
}

HP_DIST_TEST_WITH_TIMEOUT(NdParallel, Tp2Cp4ShardSize1IsBitwiseReproducible, 300,
                          8) {
  const auto first = train(200, /*reference_steps=*/1);
  const auto second = train(200, /*reference_steps=*/0);
  testing::expect_bitwise_equal(first, second);
  EXPECT_LT(first.back().loss, first.front().loss) << "it trains";
}

}  // namespace
}  // namespace hp
