// Deferred initialization, state dicts and sharded checkpoints, as docs/api.md describes
// them: a decoder built without memory, sharded over all ranks (FSDP) and given its
// values; trained with a checkpoint after each step (one saved in place, one in the
// background); resumed from the newest on another mesh (HSDP), where the next step must
// give the uninterrupted run's loss; and written as one full checkpoint file that the
// plain model loads. Exits 1 unless every check holds.
// Run with: hp-run -n 2 -- build/examples/guide/checkpoint_resume [DIR]   (any even number)
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "hyperparallel/async_checkpoint.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/fused_optimizers.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "models/transformer.h"  // this repository's decoder

using hp::models::Transformer;

constexpr int64_t kVocab = 64, kSeq = 16, kGlobalBatch = 8;

hp::models::TransformerConfig small_decoder() {
  return {.vocab = kVocab, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 64, .max_seq = kSeq};
}

// This rank's loss of step `step`'s batch (its rows of a batch every rank draws alike).
at::Tensor loss_of(hp::Sharded<Transformer>& model, int64_t step, const hp::World& world) {
  at::Generator gen = at::detail::createCPUGenerator(step);
  at::Tensor rows = torch::randint(kVocab, {kGlobalBatch, kSeq + 1}, gen, torch::kLong)
                        .chunk(world.size(), 0)[world.rank()];
  at::Tensor logits = model(rows.narrow(1, 0, kSeq));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                              rows.narrow(1, 1, kSeq).reshape(-1));
}

double train_step(hp::Sharded<Transformer>& model, torch::optim::Optimizer& optimizer, int64_t step,
                  const hp::World& world) {
  optimizer.zero_grad();
  at::Tensor loss = loss_of(model, step, world);
  loss.backward();
  optimizer.step();
  return loss.item<double>();
}

void shard(hp::Sharded<Transformer>& model, const hp::DeviceMesh& mesh) {
  for (auto& layer : model->layers) hp::fully_shard(layer, {.mesh = mesh});
  hp::fully_shard(model, {.mesh = mesh});
}

// Whether `state` holds exactly the parameters and buffers of `model`.
bool same_tensors(const hp::StateDict& state, torch::nn::Module& model) {
  bool same = state.size() == model.named_parameters().size() + model.named_buffers().size();
  for (const auto& item : model.named_parameters())
    same = same && state.contains(item.key()) && torch::equal(state[item.key()], item.value());
  for (const auto& item : model.named_buffers())
    same = same && state.contains(item.key()) && torch::equal(state[item.key()], item.value());
  return same;
}

bool check(bool ok, const char* what) {
  if (!ok || hp::default_world()->rank() == 0) std::printf("%s: %s\n", what, ok ? "ok" : "FAILED");
  return ok;
}

int main(int argc, char** argv) {
  at::set_num_threads(1);  // ranks share the cores
  const std::shared_ptr<hp::World> world = hp::default_world();
  const std::string root = argc > 1 ? argv[1] : "guide_checkpoints";
  bool ok = true;

  // Built on the meta device (no memory), sharded, then each shard gets its part of the
  // model's own initialization: no rank ever holds the whole model.
  torch::manual_seed(0);
  auto model = hp::deferred_init([] { return hp::Sharded<Transformer>(small_decoder()); });
  shard(model, hp::DeviceMesh(world, {{"dp_shard", world->size()}}));
  hp::materialize(*model);

  torch::manual_seed(0);
  Transformer eager(small_decoder());  // what an ordinary construction gives
  ok = check(same_tensors(hp::get_full_state_dict(*model), *eager),
             "deferred init + materialize == eager construction") &&
       ok;

  // One fused kernel per device and dtype; state and checkpoints as torch::optim::AdamW.
  hp::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  hp::AsyncCheckpointSaver saver;
  for (int64_t step = 0; step < 2; ++step) {
    train_step(model, optimizer, step, *world);
    hp::StateDict extra;  // what the program needs to go on: here the next step
    extra.insert("step", at::scalar_tensor(step + 1, at::kLong));
    const std::string dir = hp::checkpoint_dir_for_step(root, step + 1);
    if (step == 0) {
      hp::save_sharded_checkpoint(dir, *model, &optimizer, extra);  // returns once on disk
    } else {
      saver.save(dir, *model, &optimizer, extra);  // returns once staged; written meanwhile
    }
  }
  saver.wait();  // the background save is complete on every rank (or every rank throws)
  const double uninterrupted = train_step(model, optimizer, 2, *world);

  // A restart on another mesh: replicas of 2, shards over the rest. The model is deferred
  // again; loading the checkpoint gives it its values instead of materialize().
  auto resumed = hp::deferred_init([] { return hp::Sharded<Transformer>(small_decoder()); });
  shard(resumed, hp::DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", world->size() / 2}}));
  hp::FusedAdamW resumed_optimizer(resumed->parameters(), torch::optim::AdamWOptions(1e-2));
  const std::optional<std::string> latest = hp::latest_checkpoint(root);
  TORCH_CHECK(latest, "no complete checkpoint under ", root);
  const hp::StateDict extra = hp::load_sharded_checkpoint(*latest, *resumed, &resumed_optimizer);
  const int64_t next_step = extra["step"].item<int64_t>();
  const double after_resume = train_step(resumed, resumed_optimizer, next_step, *world);
  ok = check(next_step == 2 && std::abs(after_resume - uninterrupted) <= 1e-5,
             "resumed on HSDP: the next step's loss is the uninterrupted run's") &&
       ok;

  // One file of whole tensors, written by rank 0 a tensor at a time (torch.load reads it),
  // loaded here into the plain model on each process.
  const std::string file = root + "/model.pt";
  hp::save_full_checkpoint(*resumed, file);
  hp::barrier(*world->world_group()).wait();  // the other ranks do not wait for the file
  Transformer plain(small_decoder());
  hp::load_full_checkpoint(*plain, file);
  ok = check(same_tensors(hp::get_full_state_dict(*resumed), *plain),
             "full checkpoint file == the sharded model") &&
       ok;
  return ok ? 0 : 1;
}
