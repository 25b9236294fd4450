// The README's fully_shard example as a whole program: a two-layer MLP sharded over all
// ranks (FSDP), trained for a few AdamW steps on one fixed batch; exits 1 unless the loss
// falls. Run with: hp-run -n 2 -- build/examples/guide/fully_shard_min
#include <torch/torch.h>

#include <cstdio>
#include <vector>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"

struct NetImpl : torch::nn::Module {
  hp::Sharded<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 64));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Net);

int main() {
  torch::manual_seed(0);  // the same initial model on every rank, sharded below
  hp::Sharded<Net> net(Net{});
  hp::fully_shard(net->fc1);  // the blocks first (each gathers only for its own forward),
  hp::fully_shard(net->fc2);
  hp::fully_shard(net);  // then the root; the mesh: all ranks of the torchrun world
  torch::optim::AdamW optimizer(net->parameters(), 1e-3);  // on the shards

  const at::Tensor batch = torch::randn({8, 64});
  std::vector<float> losses;
  for (int step = 0; step < 10; ++step) {
    optimizer.zero_grad();
    at::Tensor loss = net(batch).square().mean();
    loss.backward();  // gradients reduce-scattered to the shards
    optimizer.step();
    losses.push_back(loss.item<float>());
  }
  if (hp::default_world()->rank() == 0) {
    std::printf("loss %.4f -> %.4f over 10 steps on %lld ranks\n", losses.front(), losses.back(),
                static_cast<long long>(hp::default_world()->size()));
  }
  return losses.back() < losses.front() ? 0 : 1;
}
