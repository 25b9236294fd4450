// The options of a fully_shard training step, as docs/api.md describes them, each checked
// against the default step's gradients on the same batch: gradient accumulation without
// sync, explicit prefetch, activation recomputation with activation swap (bitwise the
// same), and int8 collectives with error feedback (close). Exits 1 unless each holds.
// Run with: hp-run -n 2 -- build/examples/guide/training_options   (any number of ranks)
#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <vector>

#include "hyperparallel/activation_swap.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/recompute.h"

constexpr int64_t kDim = 32, kBlocks = 4, kBatchPerRank = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kDim, 4 * kDim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kDim, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl() {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.emplace_back(Block());
      list->push_back(blocks.back().ptr());
    }
  }
  at::Tensor forward(at::Tensor h) {
    for (auto& block : blocks) {
      std::optional<hp::SwapActivations> region;  // what the block saves leaves memory
      if (swap) region.emplace(*swap);
      h = recompute_blocks
              ? hp::recompute([block](const at::Tensor& x) mutable { return block(x); }, h)
              : block(h);
    }
    return h;
  }
  std::vector<hp::Sharded<Block>> blocks;
  bool recompute_blocks = false;           // recompute each block's activations in backward
  std::optional<hp::ActivationSwap> swap;  // set: each block's saved tensors are swapped out
};
TORCH_MODULE(Stack);

// The same stack on every run (seed 0), fully_shard-ed block by block, then the root.
hp::Sharded<Stack> sharded_stack(const hp::FullyShardOptions& options = {}) {
  torch::manual_seed(0);
  hp::Sharded<Stack> model(Stack{});
  for (auto& block : model->blocks) hp::fully_shard(block, options);
  hp::fully_shard(model, options);
  return model;
}

at::Tensor loss_of(hp::Sharded<Stack>& model, const at::Tensor& rows) {
  return model(rows).square().mean();
}

// This rank's sharded gradients, in parameter order.
std::vector<at::Tensor> sharded_grads(hp::Sharded<Stack>& model) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& param : model->parameters()) grads.push_back(param.grad().clone());
  return grads;
}

// Whether every gradient is within `tolerance` x the largest magnitude of the reference's.
bool close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
           double tolerance, const char* what) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < got.size(); ++i) {
    const double scale = want[i].abs().max().item<double>();
    ok = (got[i] - want[i]).abs().max().item<double>() <= tolerance * scale;
  }
  if (!ok || hp::default_world()->rank() == 0) std::printf("%s: %s\n", what, ok ? "ok" : "FAILED");
  return ok;
}

int main() {
  at::set_num_threads(1);  // ranks share the cores
  const std::shared_ptr<hp::World> world = hp::default_world();
  const at::Tensor rows =
      torch::randn({kBatchPerRank, kDim}, at::detail::createCPUGenerator(1 + world->rank()));
  hp::Sharded<Stack> reference = sharded_stack();
  loss_of(reference, rows).backward();
  const std::vector<at::Tensor> want = sharded_grads(reference);
  bool ok = true;

  {  // Gradient accumulation: the micro-steps keep their gradients unsharded, unreduced.
    hp::Sharded<Stack> model = sharded_stack();
    const std::vector<at::Tensor> micro = rows.chunk(2, 0);
    model.fsdp().set_requires_gradient_sync(false);  // recurses into the blocks
    (loss_of(model, micro[0]) / 2).backward();
    model.fsdp().set_requires_gradient_sync(true);  // the last micro-step reduces the sum once
    (loss_of(model, micro[1]) / 2).backward();
    ok = close(sharded_grads(model), want, 1e-5, "accumulation without sync") && ok;
  }
  {  // Explicit prefetch: each block's forward gathers the next two blocks' parameters.
    hp::Sharded<Stack> model = sharded_stack();
    std::vector<hp::FSDPModule> blocks;
    for (auto& block : model->blocks) blocks.push_back(block.fsdp());
    for (size_t i = 0; i + 1 < blocks.size(); ++i) {
      std::vector<hp::FSDPModule> next(blocks.begin() + i + 1,
                                       blocks.begin() + std::min(i + 3, blocks.size()));
      blocks[i].set_modules_to_forward_prefetch(next);
    }
    blocks.back().set_reshard_after_forward(false);  // its backward comes first: no re-gather
    loss_of(model, rows).backward();
    ok = close(sharded_grads(model), want, 0.0, "explicit prefetch") && ok;
  }
  {  // Recomputation and swap: less activation memory, the same bits.
    hp::Sharded<Stack> model = sharded_stack();
    model->recompute_blocks = true;
    model->swap.emplace(hp::ActivationSwapOptions{.min_bytes = 0});  // a file in $TMPDIR
    loss_of(model, rows).backward();
    ok = close(sharded_grads(model), want, 0.0, "recompute + activation swap") && ok;
    ok = model->swap->stats().tensors_swapped > 0 && ok;
  }
  {  // int8 all-gathers and reduce-scatters, the gradients' quantization error fed back.
    hp::FullyShardOptions options;
    options.comm_policy = {.all_gather_codec = hp::CommCodec::kInt8,
                           .reduce_scatter_codec = hp::CommCodec::kInt8,
                           .error_feedback = true};
    hp::Sharded<Stack> model = sharded_stack(options);
    loss_of(model, rows).backward();
    ok = close(sharded_grads(model), want, 0.05, "int8 collectives") && ok;
    ok = model.fsdp().error_feedback_blocks_dropped() == 0 && ok;  // all gradients finite
  }
  return ok ? 0 : 1;
}
