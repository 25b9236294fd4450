// hp::deferred_init / hp::materialize against eager construction of the same models from
// the same seed: every parameter and buffer equal bit for bit, the default generator
// untouched, nothing allocated by deferred_init, the record freed once done, and errors
// that say what went wrong. On 1-4 ranks: deferred models sharded with fully_shard before
// materialize() equal the eager model bit for bit, also with a user init function and
// after an AdamW step, and never hold more than their shards plus one parameter.
#include <ATen/Context.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>

#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/state_dict.h"
#include "models/mlp.h"
#include "models/transformer.h"
#include "models/vit.h"
#include "shared_dir.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

// CPU bytes that are not model tensors: the CPU generator's state, which the record keeps
// (~5 KB) and materialize() saves once more while it replays, and fully_shard's small
// bookkeeping tensors. Far below one parameter of the models measured here.
constexpr int64_t kSlack = 64 * 1024;

at::Tensor cpu_generator_state() {
  at::Generator generator = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Every parameter and buffer of `actual` is real and equals `expected`'s of the same name,
// bit for bit.
void expect_same_tensors(torch::nn::Module& actual, torch::nn::Module& expected) {
  auto check = [](const torch::OrderedDict<std::string, at::Tensor>& got,
                  const torch::OrderedDict<std::string, at::Tensor>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what << "s";
    for (const auto& item : want) {
      const at::Tensor* tensor = got.find(item.key());
      ASSERT_NE(tensor, nullptr) << what << " " << item.key();
      EXPECT_FALSE(is_deferred(*tensor)) << what << " " << item.key();
      EXPECT_EQ(tensor->requires_grad(), item.value().requires_grad()) << what << " " << item.key();
      ASSERT_EQ(tensor->device(), item.value().device()) << what << " " << item.key();
      EXPECT_TRUE(torch::equal(*tensor, item.value())) << what << " " << item.key();
    }
  };
  check(actual.named_parameters(), expected.named_parameters(), "parameter");
  check(actual.named_buffers(), expected.named_buffers(), "buffer");
}

// Builds `Holder(args...)` eagerly and deferred from the same seed, materializes the
// deferred one and compares; checks that deferred_init allocated and drew nothing and
// that materialize() left the generator as it was.
template <typename Holder, typename... Args>
void expect_deferred_matches_eager(uint64_t seed, const Args&... args) {
  torch::manual_seed(seed);
  Holder eager(args...);

  torch::manual_seed(seed);
  const at::Tensor generator_at_start = cpu_generator_state();
  auto& probe = testing::CpuMemoryProbe::installed();
  const int64_t live_before = probe.live();
  Holder deferred = deferred_init([&] { return Holder(args...); });
  EXPECT_LE(probe.live() - live_before, kSlack) << "deferred_init allocated tensor memory";
  EXPECT_TRUE(torch::equal(cpu_generator_state(), generator_at_start)) << "deferred_init drew";
  for (const auto& item : deferred->named_parameters()) {
    EXPECT_TRUE(item.value().is_meta() && is_deferred(item.value())) << item.key();
  }
  for (const auto& item : deferred->named_buffers()) {
    EXPECT_TRUE(item.value().is_meta() && is_deferred(item.value())) << item.key();
  }

  int64_t model_bytes = 0, largest = 0;
  for (const auto& t : eager->parameters())
    model_bytes += bytes_of(t), largest = std::max(largest, bytes_of(t));
  for (const auto& t : eager->buffers())
    model_bytes += bytes_of(t), largest = std::max(largest, bytes_of(t));
  const std::vector<at::Tensor> handles = deferred->parameters();  // e.g. an optimizer's
  const int64_t before = probe.live();
  probe.reset_peak();
  materialize(*deferred);
  EXPECT_LE(probe.peak_above(before), model_bytes + largest + kSlack) << "peak during materialize";
  EXPECT_TRUE(torch::equal(cpu_generator_state(), generator_at_start))
      << "materialize changed the default generator";
  expect_same_tensors(*deferred, *eager);
  const std::vector<at::Tensor> now = deferred->parameters();
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_TRUE(handles[i].is_same(now[i]) && !handles[i].is_meta()) << "parameter " << i;
  }
}

TEST(DeferredInit, MlpMatchesEagerConstruction) {
  expect_deferred_matches_eager<models::Mlp>(11, 7, 9, 13, 5, 2);  // LibTorch's Linear init
}

TEST(DeferredInit, TransformerMatchesEagerConstruction) {
  const TransformerConfig config{
      .vocab = 40, .dim = 32, .heads = 4, .layers = 3, .ffn_hidden = 48, .max_seq = 16};
  expect_deferred_matches_eager<Transformer>(12, config);
}

TEST(DeferredInit, VisionTransformerMatchesEagerConstruction) {
  const models::VitConfig config{.image_size = 16,
                                 .patch_size = 4,
                                 .channels = 3,
                                 .dim = 32,
                                 .heads = 4,
                                 .layers = 2,
                                 .mlp_hidden = 64,
                                 .num_classes = 10};
  expect_deferred_matches_eager<models::VisionTransformer>(13, config);
}

// Inits with views, QR and constants: orthogonal_, xavier_normal_, constant_.
struct InitZooImpl : torch::nn::Module {
  InitZooImpl() {
    torch::nn::init::orthogonal_(register_parameter("orthogonal", torch::empty({6, 4})));
    torch::nn::init::xavier_normal_(register_parameter("xavier", torch::empty({3, 5, 2})));
    torch::nn::init::constant_(register_parameter("constant", torch::empty({8})), 0.3);
  }
};
TORCH_MODULE(InitZoo);

TEST(DeferredInit, LibTorchModulesMatchEagerConstruction) {
  expect_deferred_matches_eager<torch::nn::LSTM>(31, torch::nn::LSTMOptions(4, 6).num_layers(2));
  expect_deferred_matches_eager<torch::nn::MultiheadAttention>(32, 8, 2);
  expect_deferred_matches_eager<torch::nn::BatchNorm2d>(33, 6);
  expect_deferred_matches_eager<torch::nn::Bilinear>(34, 3, 4, 5);
  expect_deferred_matches_eager<torch::nn::Transformer>(35,
                                                        torch::nn::TransformerOptions(8, 2, 1, 1));
  expect_deferred_matches_eager<InitZoo>(36);
}

// Buffers (BatchNorm), Embedding's padding row written through a view, a parameter that
// is the result of arithmetic on random draws, in-place writes through a narrow() view,
// and a buffer built by a chain of views and copies.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    embed = register_module(
        "embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).padding_idx(2)));
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
    scale = register_parameter("scale", torch::randn({3, 4}) * 0.5 + 1);
    {
      torch::NoGradGuard no_grad;
      scale.narrow(0, 1, 1).fill_(7);
      scale.narrow(1, 3, 1).uniform_(-1, 1);
    }
    table =
        register_buffer("table", torch::arange(12, torch::kFloat).reshape({3, 4}).t().contiguous());
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  at::Tensor scale, table;
};
TORCH_MODULE(Mixed);

TEST(DeferredInit, ViewsInPlaceWritesAndBuffersMatchEagerConstruction) {
  expect_deferred_matches_eager<Mixed>(14);
}

// Module::to inside the construction swaps each parameter's data (set_data) for a
// converted deferred tensor; the parameter must then stand for the converted value.
struct ConvertedImpl : torch::nn::Module {
  ConvertedImpl() : fc(register_module("fc", torch::nn::Linear(5, 3))) { to(torch::kDouble); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Converted);

TEST(DeferredInit, ModuleToDuringConstructionMatchesEagerConstruction) {
  expect_deferred_matches_eager<Converted>(17);
}

TEST(DeferredInit, NestedDeferredInitAddsToTheOuterRecord) {
  torch::manual_seed(18);
  models::Mlp eager(3, 4, 5, 2, 1);
  torch::manual_seed(18);
  models::Mlp deferred =
      deferred_init([] { return deferred_init([] { return models::Mlp(3, 4, 5, 2, 1); }); });
  EXPECT_TRUE(is_deferred(deferred->head->weight));
  materialize(*deferred);
  expect_same_tensors(*deferred, *eager);
}

TEST(DeferredInit, OpsOnRealTensorsOnlyRunForReal) {
  const at::Tensor real = torch::randn({2, 3});
  at::Tensor doubled, made;
  deferred_init([&] {
    doubled = real * 2;
    made = torch::zeros({2});
    return 0;
  });
  EXPECT_FALSE(doubled.is_meta() || is_deferred(doubled));
  EXPECT_TRUE(torch::equal(doubled, real * 2));
  EXPECT_TRUE(made.is_meta() && is_deferred(made));
}

TEST(DeferredInit, MaterializingPartsFirstMatchesEagerConstruction) {
  // Each part replays only what it needs, yet draws exactly as the whole construction did.
  const TransformerConfig config{
      .vocab = 24, .dim = 16, .heads = 2, .layers = 3, .ffn_hidden = 20, .max_seq = 8};
  torch::manual_seed(15);
  Transformer eager(config);
  torch::manual_seed(15);
  Transformer deferred = deferred_init([&] { return Transformer(config); });
  materialize(*deferred->layers[1]);
  EXPECT_FALSE(is_deferred(deferred->layers[1]->mlp->w2->weight));
  EXPECT_TRUE(is_deferred(deferred->layers[0]->mlp->w2->weight));
  materialize(*deferred->norm);
  materialize(*deferred);
  expect_same_tensors(*deferred, *eager);
}

// A user init: N(0, 0.5) from a generator seeded by the parameter's name.
void init_by_name(const std::string& name, at::Tensor& whole) {
  at::Generator generator = at::detail::createCPUGenerator(std::hash<std::string>{}(name));
  whole.normal_(0.0, 0.5, generator);
}

template <typename Holder>
void apply_init_by_name(Holder& module) {
  torch::NoGradGuard no_grad;
  for (auto& item : module->named_parameters()) init_by_name(item.key(), item.value());
}

TEST(DeferredInit, UserInitMatchesEagerModelWithTheSameInit) {
  torch::manual_seed(16);
  Mixed eager;
  apply_init_by_name(eager);
  torch::manual_seed(16);
  Mixed deferred = deferred_init([] { return Mixed(); });
  materialize(*deferred, init_by_name);
  expect_same_tensors(*deferred, *eager);  // parameters from init, buffers replayed
}

TEST(DeferredInit, UserInitThatReplacesTheTensorFails) {
  models::Mlp deferred = deferred_init([] { return models::Mlp(3, 4, 5, 2, 1); });
  const std::string message = testing::error_of([&] {
    materialize(*deferred,
                [](const std::string&, at::Tensor& whole) { whole = torch::zeros({1}); });
  });
  EXPECT_NE(message.find("'input.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("in place"), std::string::npos) << message;
}

TEST(DeferredInit, RecordIsFreedOnceMaterializedOrDropped) {
  // The record holds the real tensors the construction read; watching one tells whether
  // the record still lives.
  auto build = [](const at::Tensor& source) {
    return deferred_init([&] {
      torch::nn::Linear layer(4, 3);
      torch::NoGradGuard no_grad;
      layer->weight.copy_(source);
      return layer;
    });
  };
  at::Tensor source = torch::randn({3, 4});
  const at::Tensor expected = source.clone();
  c10::weak_intrusive_ptr<c10::TensorImpl> watch(source.getIntrusivePtr());
  torch::nn::Linear layer = build(source);
  source.reset();
  EXPECT_FALSE(watch.expired()) << "the record must keep what it will read";
  materialize(*layer);
  EXPECT_TRUE(torch::equal(layer->weight, expected));
  EXPECT_TRUE(watch.expired()) << "record still alive after everything was materialized";

  source = torch::randn({3, 4});
  watch = c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr());
  {
    torch::nn::Linear dropped = build(source);
    source.reset();
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired()) << "record still alive after the model was dropped";
}

TEST(DeferredInit, ReadingValuesDuringConstructionFails) {
  const std::string item =
      testing::error_of([] { deferred_init([] { return torch::ones({2}).sum().item<float>(); }); });
  EXPECT_NE(item.find("aten::item"), std::string::npos) << item;
  EXPECT_NE(item.find("must not read tensor values"), std::string::npos) << item;

  const std::string nonzero =
      testing::error_of([] { deferred_init([] { return torch::nonzero(torch::ones({2})); }); });
  EXPECT_NE(nonzero.find("aten::nonzero"), std::string::npos) << nonzero;
  EXPECT_NE(nonzero.find("must not read tensor values"), std::string::npos) << nonzero;

  // Recording ended with the error: tensors are real again.
  EXPECT_FALSE(torch::ones({2}).is_meta());
}

TEST(DeferredInit, WritingDeferredValuesIntoARealTensorFails) {
  at::Tensor real = torch::zeros({2});
  const std::string message =
      testing::error_of([&] { deferred_init([&] { return real.copy_(torch::ones({2})); }); });
  EXPECT_NE(message.find("aten::copy_"), std::string::npos) << message;
  EXPECT_NE(message.find("into a real tensor"), std::string::npos) << message;
}

// --- with fully_shard, on 1-4 ranks ---------------------------------------------------

TransformerConfig small_config() {
  // ffn_hidden and vocab are uneven: shards are padded on 2, 3 and 4 ranks.
  return {.vocab = 30, .dim = 16, .heads = 2, .layers = 3, .ffn_hidden = 25, .max_seq = 8};
}

// A deferred Transformer, sharded block by block and at the root, not yet materialized.
struct DeferredSharded {
  Sharded<Transformer> model;
  testing::ShardedParts parts;
};

DeferredSharded deferred_and_sharded(uint64_t seed, const TransformerConfig& config) {
  torch::manual_seed(seed);
  Sharded<Transformer> model = deferred_init([&] { return Sharded<Transformer>(config); });
  testing::ShardedParts parts = testing::shard_blocks_then_root(model->layers, model, "layers.");
  return {model, parts};
}

void expect_full_params_equal(const testing::ShardedParts& parts, torch::nn::Module& eager) {
  const auto full = testing::full_params(parts);
  const auto expected = testing::reference_params(eager);
  ASSERT_EQ(full.size(), expected.size());
  for (const auto& [name, want] : expected) {
    ASSERT_TRUE(full.count(name)) << name;
    EXPECT_TRUE(torch::equal(full.at(name), want)) << name;
  }
}

HP_DIST_TEST(DeferredInitFsdp, MaterializedShardsMatchEagerModel, 1, 2, 3, 4) {
  torch::manual_seed(21);
  Transformer eager(small_config());
  auto [model, parts] = deferred_and_sharded(21, small_config());
  for (const auto& p : model->parameters()) EXPECT_TRUE(is_deferred(p) && !p.is_meta());
  materialize(*model);
  for (const auto& p : model->parameters()) EXPECT_FALSE(is_deferred(p));
  expect_full_params_equal(parts, *eager);
}

HP_DIST_TEST(DeferredInitFsdp, UserInitMatchesEagerModelWithTheSameInit, 1, 2, 3, 4) {
  torch::manual_seed(22);
  Transformer eager(small_config());
  apply_init_by_name(eager);
  auto [model, parts] = deferred_and_sharded(22, small_config());
  materialize(*model, init_by_name);
  expect_full_params_equal(parts, *eager);
}

HP_DIST_TEST(DeferredInitFsdp, AdamWStepMatchesEagerShardedModel, 1, 2, 3, 4) {
  const TransformerConfig config = small_config();
  torch::manual_seed(23);
  Sharded<Transformer> eager(config);
  testing::ShardedParts eager_parts =
      testing::shard_blocks_then_root(eager->layers, eager, "layers.");
  auto [model, parts] = deferred_and_sharded(23, config);
  materialize(*model);

  auto group = testing::world();
  at::Generator generator = at::detail::createCPUGenerator(24);
  at::Tensor tokens =
      torch::randint(config.vocab, {12, config.max_seq + 1}, generator, torch::kLong);
  tokens = testing::local_batch(tokens, group->rank(), group->size());
  const at::Tensor input = tokens.narrow(1, 0, config.max_seq);
  const at::Tensor target = tokens.narrow(1, 1, config.max_seq);
  auto step = [&](Sharded<Transformer>& m) {
    torch::optim::AdamW optimizer(m->parameters(), torch::optim::AdamWOptions(1e-2));
    at::Tensor loss = testing::token_cross_entropy(m(input), target);
    loss.backward();
    optimizer.step();
    return loss.detach();
  };
  EXPECT_TRUE(torch::equal(step(model), step(eager))) << "loss";
  const auto expected = testing::full_params(eager_parts);
  const auto actual = testing::full_params(parts);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, want] : expected)
    EXPECT_TRUE(torch::equal(actual.at(name), want)) << name;
}

HP_DIST_TEST(DeferredInitFsdp, PeakMemoryIsShardsPlusOneParameter, 1, 2, 3, 4) {
  // Big enough that one parameter (256 x 1024 fp32: 1 MiB) dwarfs the slack.
  const TransformerConfig config{
      .vocab = 512, .dim = 256, .heads = 4, .layers = 4, .ffn_hidden = 1024, .max_seq = 128};
  auto group = testing::world();
  auto& probe = testing::CpuMemoryProbe::installed();
  const int64_t before = probe.live();
  probe.reset_peak();
  auto [model, parts] = deferred_and_sharded(25, config);
  materialize(*model);
  const int64_t peak = probe.peak_above(before);

  int64_t shard_bytes = 0, largest = 0;
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      int64_t whole = 1;
      for (int64_t extent : info.global_shape) whole *= extent;
      const int64_t rows = info.global_shape.at(0);
      const int64_t padded_rows = (rows + group->size() - 1) / group->size();
      shard_bytes += whole / rows * padded_rows * 4;
      largest = std::max(largest, whole * 4);
    }
  }
  std::printf(
      "rank %lld of %lld: peak %lld B above start; shards %lld B, largest parameter %lld B\n",
      static_cast<long long>(group->rank()), static_cast<long long>(group->size()),
      static_cast<long long>(peak), static_cast<long long>(shard_bytes),
      static_cast<long long>(largest));
  EXPECT_LE(peak, shard_bytes + largest + kSlack);
  EXPECT_LE(probe.live() - before, shard_bytes + kSlack) << "left allocated after materialize";
}

// Whole bytes of every sharded parameter of `parts`, and of the largest one.
std::pair<int64_t, int64_t> whole_and_largest_bytes(const testing::ShardedParts& parts) {
  int64_t total = 0, largest = 0;
  for (const auto& [prefix, module] : parts) {
    for (const auto& info : module.sharded_params()) {
      int64_t whole = 4;
      for (int64_t extent : info.global_shape) whole *= extent;
      total += whole;
      largest = std::max(largest, whole);
    }
  }
  return {total, largest};
}

HP_DIST_TEST(DeferredInitFsdp, FullCheckpointLoadsInsteadOfMaterialize, 2, 4) {
  const TransformerConfig config{
      .vocab = 512, .dim = 256, .heads = 4, .layers = 4, .ffn_hidden = 1024, .max_seq = 128};
  const std::string dir = testing::shared_dir("hp_deferred_checkpoint");
  const std::string path = dir + "/model.pt";
  torch::manual_seed(26);
  Sharded<Transformer> eager(config);
  testing::ShardedParts eager_parts =
      testing::shard_blocks_then_root(eager->layers, eager, "layers.");
  save_full_checkpoint(*eager, path);
  barrier(*testing::world()->world_group()).wait();  // rank 0 wrote it

  auto& probe = testing::CpuMemoryProbe::installed();
  auto [model, parts] = deferred_and_sharded(27, config);
  const int64_t before = probe.settled_live();
  probe.reset_peak();
  load_full_checkpoint(*model, path);
  const int64_t peak = probe.peak_above(before);
  for (const auto& p : model->parameters()) EXPECT_FALSE(is_deferred(p));
  for (const auto& b : model->buffers()) EXPECT_FALSE(is_deferred(b));
  materialize(*model);  // nothing left to do: the checkpoint's values stay
  const auto expected = testing::full_params(eager_parts);
  const auto actual = testing::full_params(parts);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, want] : expected) {
    EXPECT_TRUE(torch::equal(actual.at(name), want)) << name;
  }

  // The reader's whole tensor, and at most one more while the next is read.
  const auto [whole_model, largest] = whole_and_largest_bytes(parts);
  EXPECT_LE(peak, 2 * largest + kSlack) << "peak above the shards during the load";
  EXPECT_LT(peak, whole_model / 4) << "the load held a large part of the model";
  testing::remove_after_all_ranks(dir);
}

// A module whose parameter is a meta tensor deferred_init did not make.
struct MetaParamImpl : torch::nn::Module {
  MetaParamImpl() : weight(register_parameter("weight", torch::empty({4, 4}, torch::kMeta))) {}
  at::Tensor forward(const at::Tensor& x) { return x.matmul(weight); }
  at::Tensor weight;
};
TORCH_MODULE(MetaParam);

HP_DIST_TEST(DeferredInitFsdp, ShardingAMetaTensorNotFromDeferredInitFails, 1) {
  Sharded<MetaParam> module;
  const std::string message = testing::error_of([&] { fully_shard(module); });
  EXPECT_NE(message.find("did not make"), std::string::npos) << message;
  EXPECT_NE(message.find("hp::deferred_init"), std::string::npos) << message;
}

}  // namespace
}  // namespace hp
