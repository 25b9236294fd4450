// Tensor, context, expert and pipeline parallelism composed with fully_shard on one
// named mesh, as docs/api.md describes them. On 4 ranks, 2 data-parallel x 2 of each
// kind: the decoder of models/transformer.h trained a few SGD steps with tp, cp and ep
// (an MLP cut into stages for the pipeline), each against the same model trained on one
// process with the whole batch. Exits 1 unless every step's loss and gradient norm match the
// reference. Run with: hp-run -n 4 -- build/examples/guide/parallel_composition
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "hyperparallel/clip_grad.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/pipeline.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/tensor_parallel.h"
#include "models/transformer.h"  // this repository's decoder

using hp::models::Transformer;
using hp::models::TransformerConfig;

constexpr int64_t kVocab = 64, kSeq = 16, kGlobalBatch = 4, kSteps = 3;
constexpr double kLearningRate = 0.1, kNoClipping = 1e9;

TransformerConfig small_decoder() {
  return {.vocab = kVocab, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 64, .max_seq = kSeq};
}

// Step `step`'s batch of token rows [kGlobalBatch, kSeq + 1], the same on every rank.
at::Tensor global_batch(int64_t step) {
  at::Generator gen = at::detail::createCPUGenerator(step);
  return torch::randint(kVocab, {kGlobalBatch, kSeq + 1}, gen, torch::kLong);
}

at::Tensor inputs_of(const at::Tensor& rows) { return rows.narrow(1, 0, kSeq); }
at::Tensor targets_of(const at::Tensor& rows) { return rows.narrow(1, 1, kSeq); }

at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape(-1));
}

// Each step's loss averaged over `ranks` (every rank's loss is a mean over as many
// tokens, so their mean is the loss of the whole batch); no group: this process's loss.
double mean_over(const at::Tensor& loss, const hp::GroupPtr& ranks) {
  at::Tensor mean = loss.detach().clone();
  if (ranks) hp::all_reduce(mean, hp::ReduceOp::kAvg, *ranks).wait();
  return mean.item<double>();
}

// kSteps SGD steps (not Adam, whose steps would hide a gradient off by a constant factor);
// loss_of(step) is this rank's loss of that step's batch. Returns each step's loss averaged
// over `ranks`, then the norm of the whole gradients (slices and shards put together).
std::vector<double> train(torch::nn::Module& model,
                          const std::function<at::Tensor(int64_t)>& loss_of,
                          const hp::GroupPtr& ranks = nullptr) {
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(kLearningRate));
  std::vector<double> values;
  for (int64_t step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    at::Tensor loss = loss_of(step);
    loss.backward();
    const double grad_norm = hp::clip_grad_norm_(model.parameters(), kNoClipping);
    optimizer.step();
    values.push_back(mean_over(loss, ranks));
    values.push_back(grad_norm);
  }
  return values;
}

// The decoder on one process, from the same seed, on the whole batch.
std::vector<double> reference_values(const TransformerConfig& config) {
  torch::manual_seed(0);
  Transformer model(config);
  return train(*model, [&](int64_t step) {
    const at::Tensor rows = global_batch(step);
    return token_cross_entropy(model(inputs_of(rows)), targets_of(rows));
  });
}

// 2 data-parallel shards x 2 tensor-parallel ranks.
std::vector<double> tensor_parallel_values(const std::shared_ptr<hp::World>& world) {
  hp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
  TransformerConfig config = small_decoder();
  config.tensor_parallel = mesh.group("tp");  // heads, FFN units and vocabulary split
  torch::manual_seed(0);  // every rank draws the whole model and keeps its slices
  hp::Sharded<Transformer> model(config);
  const hp::DeviceMesh fsdp_mesh = mesh.slice({"dp_shard"});  // shards of the slices, not over tp
  for (auto& layer : model->layers) hp::fully_shard(layer, {.mesh = fsdp_mesh});
  hp::fully_shard(model, {.mesh = fsdp_mesh});

  return train(
      *model,
      [&](int64_t step) {
        // The tp ranks of a data-parallel shard read the same rows.
        const at::Tensor rows = global_batch(step).chunk(2, 0)[mesh.coordinate("dp_shard")];
        at::Tensor logits = model(inputs_of(rows));  // this rank's vocabulary slice
        return hp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                targets_of(rows).reshape(-1),
                                                config.tensor_parallel);
      },
      world->world_group());
}

// 2 data-parallel shards x 2 context-parallel ranks, fully_shard-ed over all 4.
std::vector<double> context_parallel_values(const std::shared_ptr<hp::World>& world) {
  hp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"cp", 2}});
  mesh.flatten({"dp_shard", "cp"}, "dp_shard_cp");  // the model is replicated over cp
  const hp::DeviceMesh fsdp_mesh = mesh.slice({"dp_shard_cp"});
  TransformerConfig config = small_decoder();
  config.context_parallel = mesh.group("cp");  // load-balanced layout by default
  torch::manual_seed(0);
  hp::Sharded<Transformer> model(config);
  for (auto& layer : model->layers) hp::fully_shard(layer, {.mesh = fsdp_mesh});
  hp::fully_shard(model, {.mesh = fsdp_mesh});

  return train(
      *model,
      [&](int64_t step) {
        const at::Tensor rows = global_batch(step).chunk(2, 0)[mesh.coordinate("dp_shard")];
        // Inputs and targets cut alike: this rank's part of every sequence.
        at::Tensor input = hp::shard_sequence(inputs_of(rows), config.context_parallel);
        at::Tensor target = hp::shard_sequence(targets_of(rows), config.context_parallel);
        return token_cross_entropy(model(input), target);  // gradients averaged over dp x cp
      },
      world->world_group());
}

// Experts over 2 ep ranks, each expert fully_shard-ed over the 2 ranks orthogonal to ep;
// the dense parameters over all 4.
std::vector<double> expert_parallel_values(const std::shared_ptr<hp::World>& world,
                                           const TransformerConfig& moe_decoder) {
  hp::DeviceMesh mesh(world, {{"dp_shard", 2}, {"ep", 2}});
  mesh.flatten({"dp_shard", "ep"}, "dp_shard_ep");  // all data ranks
  const hp::DeviceMesh dense_mesh = mesh.slice({"dp_shard_ep"});
  TransformerConfig config = moe_decoder;
  config.expert_parallel = mesh.group("ep");
  torch::manual_seed(0);  // the same model on every rank; each keeps its experts
  hp::Sharded<Transformer> model(config);
  for (auto& layer : model->layers) {  // experts first, over the dims orthogonal to ep
    if (!layer->moe) continue;
    hp::fully_shard(layer->moe->experts, {.mesh = mesh.slice({"dp_shard"})})
        .set_gradient_divide_factor(
            4);  // an expert's gradient sums all dp_shard x ep ranks' tokens
  }
  for (auto& layer : model->layers) hp::fully_shard(layer, {.mesh = dense_mesh});
  hp::fully_shard(model, {.mesh = dense_mesh});

  return train(
      *model,
      [&](int64_t step) {
        const at::Tensor rows = global_batch(step).chunk(world->size(), 0)[world->rank()];
        return token_cross_entropy(model(inputs_of(rows)), targets_of(rows)) + model->aux_loss();
      },
      world->world_group());
}

// One stage of the pipelined MLP.
struct StageImpl : torch::nn::Module {
  explicit StageImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Stage);

constexpr int64_t kWidth = 16, kStages = 4, kMicrobatches = 4;

// Every stage of the MLP, drawn from one seed: what each rank keeps a part of.
std::vector<Stage> whole_mlp() {
  torch::manual_seed(0);
  std::vector<Stage> stages;
  for (int64_t s = 0; s < kStages; ++s) stages.emplace_back(kWidth);
  return stages;
}

std::pair<at::Tensor, at::Tensor> regression_batch(int64_t step) {
  at::Generator gen = at::detail::createCPUGenerator(100 + step);
  return {torch::randn({8, kWidth}, gen), torch::randn({8, kWidth}, gen)};
}

// The MLP on one process, from the same seed, on the whole batch.
std::vector<double> reference_pipeline_values() {
  std::vector<Stage> stages = whole_mlp();
  torch::nn::Sequential mlp;
  for (auto& stage : stages) mlp->push_back(stage);
  return train(*mlp, [&](int64_t step) {
    auto [input, target] = regression_batch(step);
    return torch::mse_loss(mlp->forward(input), target);
  });
}

// 2 pipeline ranks x 2 data-parallel shards; each rank holds 2 chunks of the 4-stage MLP
// (interleaved: chunk v of pipeline rank r is stage 2v + r). Losses on the last stage's
// ranks (with the gradient norm), empty on the others.
std::vector<double> pipeline_values(const std::shared_ptr<hp::World>& world) {
  hp::DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}});
  const int64_t r = mesh.coordinate("pp");
  std::vector<Stage> stages = whole_mlp();
  std::vector<at::Tensor> held;  // this rank's chunks' parameters, for the optimizer
  std::vector<hp::PipelineStage> chunks;
  for (int64_t v = 0; v < 2; ++v) {
    hp::Sharded<Stage> chunk = stages[2 * v + r];
    chunks.push_back({.forward = [chunk](const at::Tensor& x) mutable { return chunk(x); },
                      .group = mesh.group("pp"),
                      .fsdp = hp::fully_shard(chunk, {.mesh = mesh.slice({"dp_shard"})})});
    for (const at::Tensor& param : chunk->parameters()) held.push_back(param);
  }
  hp::InterleavedOneFOneBSchedule schedule(chunks, kMicrobatches,
                                           [](const at::Tensor& output, const at::Tensor& target) {
                                             return torch::mse_loss(output, target);
                                           });

  const bool first = r == 0, last = r == 1;
  const int64_t shard = mesh.coordinate("dp_shard");  // this rank's rows of each batch
  torch::optim::SGD optimizer(held, torch::optim::SGDOptions(kLearningRate));
  std::vector<double> values;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [input, target] = regression_batch(step);
    optimizer.zero_grad();
    const hp::PipelineStepResult result =  // forward and backward of every microbatch
        schedule.step(first ? input.chunk(2, 0)[shard] : at::Tensor(),
                      last ? target.chunk(2, 0)[shard] : at::Tensor());
    // The whole gradients' norm: this rank's stages', then over the pipeline.
    at::Tensor squares = torch::tensor(std::pow(hp::clip_grad_norm_(held, kNoClipping), 2));
    hp::all_reduce(squares, hp::ReduceOp::kSum, *mesh.group("pp")).wait();
    optimizer.step();
    if (last) {
      values.push_back(mean_over(result.loss, mesh.group("dp_shard")));
      values.push_back(std::sqrt(squares.item<double>()));
    }
  }
  return values;
}

// Whether every step's loss and gradient norm are the reference's, within fp32 reordering.
bool matches(const char* what, const std::vector<double>& got, const std::vector<double>& want) {
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < got.size(); ++i)
    same = std::abs(got[i] - want[i]) <= 1e-5 * std::max(1.0, std::abs(want[i]));
  for (size_t i = 0; i + 1 < got.size() && !same; i += 2) {
    std::printf("%s step %zu: loss %.6f, grad norm %.6f; reference %.6f, %.6f\n", what, i / 2,
                got[i], got[i + 1], want[i], want[i + 1]);
  }
  return same;
}

int main() {
  at::set_num_threads(1);  // ranks share the cores
  const std::shared_ptr<hp::World> world = hp::default_world();
  TORCH_CHECK(world->size() == 4, "run on 4 ranks: hp-run -n 4 -- parallel_composition");
  // No balancing loss: each rank's would balance its own tokens, not the whole batch's.
  TransformerConfig moe_decoder = small_decoder();
  moe_decoder.moe = {.layers = {1}, .num_experts = 4, .top_k = 2, .expert_hidden = 64};

  bool ok = matches("tp", tensor_parallel_values(world), reference_values(small_decoder()));
  ok = matches("cp", context_parallel_values(world), reference_values(small_decoder())) && ok;
  ok = matches("ep", expert_parallel_values(world, moe_decoder), reference_values(moe_decoder)) &&
       ok;
  const std::vector<double> pipelined = pipeline_values(world);
  if (!pipelined.empty()) ok = matches("pp", pipelined, reference_pipeline_values()) && ok;

  at::Tensor all_ok = torch::tensor(ok ? 1.0f : 0.0f);  // the pipeline's losses are on 2 ranks
  hp::all_reduce(all_ok, hp::ReduceOp::kMin, *world->world_group()).wait();
  ok = all_ok.item<float>() == 1.0f;
  if (world->rank() == 0)
    std::printf("tp, cp, ep, pp: %s\n", ok ? "every loss is the reference's" : "MISMATCH");
  return ok ? 0 : 1;
}
