// The C++ side of the checkpoint interoperability test with PyTorch's Distributed
// Checkpoint (dcp_interop.sh; the Python side is tests/python/dcp_interop.py). Run under
// hp-run, every rank:
//
//   dcp_interop export DIR    trains models/transformer.h's Transformer (fully_shard-ed on
//                             every layer and the root) two AdamW steps and saves it with
//                             hp::save_sharded_checkpoint, the optimizer state and the extras
//                             "tokens" (a batch) and "loss" (its loss with the saved model)
//   dcp_interop import DIR... loads each directory PyTorch's HuggingFaceStorageWriter wrote
//                             with hp::load_sharded_checkpoint (plain model on one rank,
//                             fully_shard-ed on more) and checks it against DIR-reference.pt:
//                             every tensor bitwise, the loss of its batch within 1e-6; on
//                             one rank also hp::convert_to_full_checkpoint's file of it
//   dcp_interop refuse DIR TEXT  loading DIR must fail on every rank, saying TEXT
//
// A batch is int64 tokens [B, T + 1]; its loss is the mean next-token cross-entropy of the
// logits of tokens[:, :T] against tokens[:, 1:]. kConfig is dcp_interop.py's CONFIG.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "models/transformer.h"

namespace {

using hp::models::Transformer;

const hp::models::TransformerConfig kConfig{
    .vocab = 64, .dim = 32, .heads = 4, .layers = 2, .ffn_hidden = 64, .max_seq = 16};
constexpr int64_t kBatch = 4;
constexpr double kLossTolerance = 1e-6;

at::Tensor batch_loss(hp::Sharded<Transformer>& model, const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1) - 1;
  at::Tensor logits = model(tokens.narrow(1, 0, seq));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              tokens.narrow(1, 1, seq).reshape(-1));
}

// The Transformer from `seed`, fully_shard-ed on every layer and the root over all ranks
// when there are several.
hp::Sharded<Transformer> build_model(uint64_t seed, int64_t world_size) {
  torch::manual_seed(seed);
  hp::Sharded<Transformer> model(kConfig);
  if (world_size > 1) {
    for (auto& layer : model->layers) hp::fully_shard(layer);
    hp::fully_shard(model);
  }
  return model;
}

void export_checkpoint(const std::string& dir, const hp::World& world) {
  hp::Sharded<Transformer> model = build_model(3, world.size());
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t step = 0; step < 2; ++step) {
    // Every rank draws the global batch and trains on its share.
    at::Tensor tokens = torch::randint(kConfig.vocab, {kBatch * world.size(), kConfig.max_seq + 1},
                                       at::detail::createCPUGenerator(100 + step), torch::kLong)
                            .chunk(world.size(), 0)[world.rank()];
    optimizer.zero_grad();
    batch_loss(model, tokens).backward();
    optimizer.step();
  }
  at::Tensor tokens = torch::randint(kConfig.vocab, {kBatch, kConfig.max_seq + 1},
                                     at::detail::createCPUGenerator(7), torch::kLong);
  at::Tensor loss;
  {
    torch::NoGradGuard no_grad;
    loss = batch_loss(model, tokens);  // every rank: the whole batch with the saved model
  }
  hp::StateDict extra;
  extra.insert("tokens", tokens);
  extra.insert("loss", loss);
  hp::save_sharded_checkpoint(dir, *model, &optimizer, extra);
  if (world.rank() == 0) std::printf("exported %s: loss %.9g\n", dir.c_str(), loss.item<double>());
}

// Whether `state` holds the model tensors of `reference` (all but "extra/..."), bitwise and
// nothing else; otherwise says what differs, as `where`.
bool holds_reference_model(const hp::StateDict& state, const hp::StateDict& reference,
                           const std::string& where) {
  size_t model_entries = 0;
  for (const auto& item : reference) {
    if (item.key().starts_with("extra/")) continue;
    ++model_entries;
    const at::Tensor* got = state.find(item.key());
    if (got == nullptr || got->scalar_type() != item.value().scalar_type() ||
        !torch::equal(*got, item.value())) {
      std::printf("FAILED %s: '%s' %s\n", where.c_str(), item.key().c_str(),
                  got ? "differs from the reference" : "is missing");
      return false;
    }
  }
  if (model_entries != state.size()) {
    std::printf("FAILED %s: the reference has %zu model tensors, not %zu\n", where.c_str(),
                model_entries, state.size());
    return false;
  }
  return true;
}

// Whether `dir` (written by PyTorch) loads into the model on this world as it was saved
// and, on one rank, converts to a full checkpoint file holding the same tensors.
bool import_checkpoint(const std::string& dir, const hp::World& world) {
  const std::string where = dir + " on " + std::to_string(world.size()) + " rank(s), rank " +
                            std::to_string(world.rank());
  hp::Sharded<Transformer> model = build_model(99, world.size());  // unlike the saved values
  const hp::StateDict extras = hp::load_sharded_checkpoint(dir, *model);
  if (!extras.is_empty()) {
    std::printf("FAILED %s: a PyTorch checkpoint returned %zu extras, expected none\n",
                where.c_str(), extras.size());
    return false;
  }

  const hp::StateDict reference = hp::read_state_dict_file(dir + "-reference.pt");
  const hp::StateDict loaded = hp::get_full_state_dict(*model);
  if (!holds_reference_model(loaded, reference, where)) return false;
  if (world.size() == 1) {
    const std::string converted = dir + "-converted.pt";
    hp::convert_to_full_checkpoint(dir, converted);
    if (!holds_reference_model(hp::read_state_dict_file(converted), reference,
                               "converting " + dir)) {
      return false;
    }
  }

  double loss = 0;
  {
    torch::NoGradGuard no_grad;
    loss = batch_loss(model, reference["extra/tokens"]).item<double>();
  }
  const double expected = reference["extra/loss"].item<double>();
  const double diff = std::abs(loss - expected);
  std::printf("%s: %zu tensors bitwise equal%s; loss %.9g, expected %.9g (diff %.3g)\n",
              where.c_str(), loaded.size(), world.size() == 1 ? ", converted too" : "", loss,
              expected, diff);
  if (!(diff <= kLossTolerance)) {
    std::printf("FAILED %s: the loss differs by %.3g (> %g)\n", where.c_str(), diff,
                kLossTolerance);
    return false;
  }
  return true;
}

// Whether loading `dir` fails on every rank with an error that says `expected`.
bool refuses(const std::string& dir, const std::string& expected, const hp::World& world) {
  hp::Sharded<Transformer> model = build_model(99, world.size());
  try {
    hp::load_sharded_checkpoint(dir, *model);
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    const bool named = message.find(expected) != std::string::npos;
    std::printf("%s %s: refused (%s)\n", named ? "as expected," : "FAILED", dir.c_str(),
                message.c_str());
    return named;
  }
  std::printf("FAILED %s: loaded; expected an error saying '%s'\n", dir.c_str(), expected.c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc >= 3 ? argv[1] : "";
  if (!(mode == "export" && argc == 3) && mode != "import" && !(mode == "refuse" && argc == 4)) {
    std::fprintf(stderr, "usage: hp-run -n N -- %s export DIR | import DIR... | refuse DIR TEXT\n",
                 argv[0]);
    return 2;
  }
  at::set_num_threads(1);  // the ranks share the machine's cores
  try {
    const std::shared_ptr<hp::World> world = hp::default_world();
    if (mode == "export") {
      export_checkpoint(argv[2], *world);
      return 0;
    }
    if (mode == "refuse") return refuses(argv[2], argv[3], *world) ? 0 : 1;
    bool ok = true;
    for (int i = 2; i < argc; ++i) ok = import_checkpoint(argv[i], *world) && ok;
    return ok ? 0 : 1;
  } catch (const c10::Error& error) {  // its what() ends in a C++ backtrace
    std::fprintf(stderr, "dcp_interop %s: %s\n", mode.c_str(), error.what_without_backtrace());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "dcp_interop %s: %s\n", mode.c_str(), error.what());
    return 1;
  }
}
