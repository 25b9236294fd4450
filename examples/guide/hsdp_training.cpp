// HSDP training with mixed precision, as docs/api.md describes it: a small decoder, its
// blocks fully_shard-ed and then the root, on a 2 x N/2 mesh (replicate x shard), bf16
// compute with fp32 gradient reduction, global-norm clipping, AdamW.
// Run with: hp-run -n 4 -- build/examples/guide/hsdp_training   (any even number of ranks)
#include <torch/torch.h>

#include <cstdio>

#include "hyperparallel/clip_grad.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t hidden)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::gelu(fc1(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct DecoderImpl : torch::nn::Module {
  DecoderImpl(int64_t vocab, int64_t dim, int64_t layers) {
    embed = register_module("embed", torch::nn::Embedding(vocab, dim));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      blocks.emplace_back(Block(dim, 4 * dim));
      list->push_back(blocks.back().ptr());  // parameters named "layers.0.fc1.weight", ...
    }
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);
    for (auto& block : blocks) h = block(h);                 // through Sharded<Block>::operator()
    return torch::nn::functional::linear(h, embed->weight);  // output tied to the embedding
  }
  torch::nn::Embedding embed{nullptr};
  std::vector<hp::Sharded<Block>> blocks;  // Sharded<...>: fully_shard can intercept forward
};
TORCH_MODULE(Decoder);

int main() {
  at::set_num_threads(1);                                  // ranks share the cores
  std::shared_ptr<hp::World> world = hp::default_world();  // RANK, WORLD_SIZE, MASTER_* from hp-run
  const int64_t vocab = 64, seq = 32, global_batch = 32;

  torch::manual_seed(0);  // the same initial model on every rank
  hp::Sharded<Decoder> model(vocab, /*dim=*/64, /*layers=*/2);

  hp::FullyShardOptions options;
  options.mesh = hp::DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", world->size() / 2}});
  options.mp_policy.param_dtype = at::kBFloat16;  // all-gather and compute in bf16
  options.mp_policy.reduce_dtype = at::kFloat;    // reduce gradients in fp32
  for (auto& block : model->blocks) hp::fully_shard(block, options);  // blocks first ...
  hp::FSDPModule root = hp::fully_shard(model, options);              // ... then the root

  // model->parameters() are now this rank's shards (fp32); the optimizer keeps them.
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first_loss = 0, last_loss = 0;
  for (int64_t step = 0; step < 40; ++step) {
    // Every rank draws the same global batch and takes its data-parallel slice.
    at::Generator gen = at::detail::createCPUGenerator(step);
    at::Tensor tokens = torch::randint(vocab, {global_batch, seq + 1}, gen, torch::kLong)
                            .chunk(world->size(), 0)[world->rank()];
    at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);

    optimizer.zero_grad();
    at::Tensor logits = model(input).to(at::kFloat);  // bf16 logits -> fp32 for the loss
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), target.reshape(-1));
    loss.backward();  // gradients reduce-scattered (shard dim) and all-reduced (replicate dim)
    hp::clip_grad_norm_(model->parameters(), /*max_norm=*/1.0);  // norm of the whole grads
    optimizer.step();                                            // updates the shards
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (world->rank() == 0 && step % 10 == 0)
      std::printf("step %lld loss %.4f\n", (long long)step, last_loss);
  }
  return last_loss < first_loss ? 0 : 1;  // each rank's share of the batch learned
}
