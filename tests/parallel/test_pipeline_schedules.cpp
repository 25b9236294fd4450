// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) against the single-process model on
// the global batch: loss, every gradient and every stage-boundary gradient within 1e-5, on
// 2 and 4 stages, with as many microbatches as stages and twice as many, alone and with 2
// fully_shard ranks per stage. Every schedule is bitwise equal to GPipe (the same
// arithmetic, in the same order per stage), and a rerun to itself. A traced step runs the
// schedule's table, each receive posted before the action ahead of it computes; 1F1B holds
// the activations of at most the microbatches its table says (S-1-r ahead of a forward on
// rank r), GPipe of all of them.
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/expert_parallel.h"
#include "hyperparallel/mesh.h"
#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/pipeline.h"
#include "hyperparallel/tensor_parallel.h"
#include "hyperparallel/trace.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;
using models::MlpBlock;
using testing::error_of;

constexpr int64_t kBlocksPerStage = 2, kIn = 5, kDim = 8, kHidden = 64, kOut = 3, kBatch = 8;

// Stage `stage` of `stages` of the whole MLP: the input projection (first stage), its
// blocks, the head (last stage); copies of the whole model's parameters.
struct StageImpl : torch::nn::Module {
  StageImpl(Mlp& whole, int64_t stage, int64_t stages) : first_block(stage * kBlocksPerStage) {
    torch::NoGradGuard no_grad;
    auto copy = [](torch::nn::Linear from) {
      torch::nn::Linear to(from->options);
      to->weight.copy_(from->weight);
      to->bias.copy_(from->bias);
      return to;
    };
    if (stage == 0) input = register_module("input", copy(whole->input));
    for (int64_t i = 0; i < kBlocksPerStage; ++i) {
      auto& from = whole->blocks[first_block + i];
      MlpBlock block(kDim, kHidden);
      block->fc1 = block->replace_module("fc1", copy(from->fc1));
      block->fc2 = block->replace_module("fc2", copy(from->fc2));
      blocks.push_back(register_module("block" + std::to_string(i), block));
    }
    if (stage == stages - 1) head = register_module("head", copy(whole->head));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = input ? input(x) : x;
    for (auto& block : blocks) h = block(h);
    return head ? head(h) : h;
  }
  // This stage's parameter `name` as the whole model names it.
  std::string whole_name(const std::string& name) const {
    if (!name.starts_with("block")) return name;
    const int64_t i = name[5] - '0';
    return "blocks." + std::to_string(first_block + i) + name.substr(6);
  }
  int64_t first_block;
  torch::nn::Linear input{nullptr}, head{nullptr};
  std::vector<MlpBlock> blocks;
};
TORCH_MODULE(Stage);

enum class Kind { kGPipe, kOneFOneB, kInterleaved };
const char* name_of(Kind kind) {
  return kind == Kind::kGPipe ? "GPipe" : kind == Kind::kOneFOneB ? "1F1B" : "interleaved";
}

// The reference: the whole model on the global batch, with the gradient of every stage
// boundary (the input of stage s > 0, concatenated microbatches).
struct Reference {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
  std::vector<at::Tensor> boundary_grads;  // [s]: of stage s's input
};

Reference reference_step(Mlp& whole, int64_t stages, const at::Tensor& x, const at::Tensor& y) {
  Reference result;
  at::Tensor h = whole->input(x);
  std::vector<at::Tensor> boundaries(stages);
  for (int64_t s = 0; s < stages; ++s) {
    if (s > 0) {
      h.retain_grad();
      boundaries[s] = h;
    }
    for (int64_t i = 0; i < kBlocksPerStage; ++i) h = whole->blocks[s * kBlocksPerStage + i](h);
  }
  result.loss = torch::mse_loss(whole->head(h), y);
  result.loss.backward();
  result.grads = testing::reference_grads(*whole);
  for (auto& boundary : boundaries) {
    result.boundary_grads.push_back(boundary.defined() ? boundary.grad() : at::Tensor());
  }
  return result;
}

std::unique_ptr<PipelineSchedule> make_schedule(Kind kind, std::vector<PipelineStage> parts,
                                                int64_t microbatches) {
  if (kind == Kind::kGPipe) {
    return std::make_unique<GPipeSchedule>(parts.front(), microbatches, testing::mse_loss);
  }
  if (kind == Kind::kOneFOneB) {
    return std::make_unique<OneFOneBSchedule>(parts.front(), microbatches, testing::mse_loss);
  }
  return std::make_unique<InterleavedOneFOneBSchedule>(std::move(parts), microbatches,
                                                       testing::mse_loss);
}

// This rank's stages under `kind`: one, or (interleaved) two, stage v*S + rank being chunk v.
struct RankStages {
  std::vector<Stage> modules;
  std::vector<std::optional<FSDPModule>> fsdp;  // per chunk, when fully_shard-ed
  std::unique_ptr<PipelineSchedule> schedule;
};

RankStages build(Kind kind, Mlp& whole, const GroupPtr& pp, int64_t microbatches,
                 const std::optional<DeviceMesh>& dp_mesh = std::nullopt) {
  const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1;
  const int64_t stages = chunks * pp->size();
  RankStages result;
  std::vector<PipelineStage> parts;
  for (int64_t v = 0; v < chunks; ++v) {
    Stage module(whole, v * pp->size() + pp->rank(), stages);
    PipelineStage part{.forward = [module](const at::Tensor& x) mutable { return module(x); },
                       .group = pp};
    if (dp_mesh) {
      Sharded<Stage> sharded(module);
      part.fsdp = fully_shard(sharded, {.mesh = *dp_mesh});
      part.forward = [sharded](const at::Tensor& x) mutable { return sharded(x); };
    }
    result.modules.push_back(module);
    result.fsdp.push_back(part.fsdp);
    parts.push_back(std::move(part));
  }
  result.schedule = make_schedule(kind, std::move(parts), microbatches);
  return result;
}

// This rank's gradients, named as the whole model names them (whole tensors).
std::map<std::string, at::Tensor> stage_grads(RankStages& stages) {
  std::map<std::string, at::Tensor> grads;
  for (size_t v = 0; v < stages.modules.size(); ++v) {
    Stage& module = stages.modules[v];
    for (const auto& item : module->named_parameters()) {
      grads[module->whole_name(item.key())] =
          stages.fsdp[v] ? stages.fsdp[v]->full_grad(item.key()) : item.value().grad().clone();
    }
  }
  return grads;
}

// Pure pipeline parallelism on all ranks: each schedule against the reference, bitwise
// equal to GPipe on the same stages, and a rerun bitwise equal to the first run.
HP_DIST_TEST(PipelineSchedules, EachMatchesTheReferenceAndGPipeBitwise, 2, 4) {
  auto world = testing::world();
  const GroupPtr pp = world->world_group();
  const int64_t ranks = pp->size(), rank = pp->rank();
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (int64_t microbatches : {ranks, 2 * ranks}) {
    std::map<int64_t, std::map<std::string, at::Tensor>> gpipe_grads;  // by chunk count
    for (Kind kind : {Kind::kGPipe, Kind::kOneFOneB, Kind::kInterleaved}) {
      SCOPED_TRACE(std::string(name_of(kind)) + ", " + std::to_string(microbatches) +
                   " microbatches");
      const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1;
      const int64_t stages = chunks * ranks;
      torch::manual_seed(42);
      Mlp whole(kIn, kDim, kHidden, kOut, stages * kBlocksPerStage);
      RankStages mine = build(kind, whole, pp, microbatches);
      const Reference reference = reference_step(whole, stages, x, y);
      const bool first = rank == 0, last = rank == ranks - 1;
      const PipelineStepResult result =
          mine.schedule->step(first ? x : at::Tensor(), last ? y : at::Tensor());
      if (last) EXPECT_NEAR(result.loss.item<double>(), reference.loss.item<double>(), 1e-5);
      const auto grads = stage_grads(mine);
      for (const auto& [name, grad] : grads) {
        EXPECT_TRUE(torch::allclose(grad, reference.grads.at(name), 0, 1e-5)) << name;
      }
      for (int64_t v = 0; v < chunks; ++v) {
        const int64_t stage = v * ranks + rank;
        if (stage > 0) {
          EXPECT_TRUE(
              torch::allclose(result.input_grads[v], reference.boundary_grads[stage], 0, 1e-5))
              << "the gradient stage " << stage << " sent back";
        }
        if (stage < stages - 1) {
          EXPECT_TRUE(
              torch::allclose(result.output_grads[v], reference.boundary_grads[stage + 1], 0, 1e-5))
              << "the gradient stage " << stage << " received";
        }
      }
      // A rerun from zeroed gradients gives the same bits.
      for (auto& module : mine.modules) module->zero_grad();
      mine.schedule->step(first ? x : at::Tensor(), last ? y : at::Tensor());
      for (const auto& [name, grad] : stage_grads(mine)) {
        EXPECT_TRUE(torch::equal(grad, grads.at(name))) << "rerun " << name;
      }
      if (kind == Kind::kGPipe) {
        gpipe_grads[1] = grads;
      } else if (kind == Kind::kOneFOneB) {
        for (const auto& [name, grad] : grads) {
          EXPECT_TRUE(torch::equal(grad, gpipe_grads[1].at(name))) << "1F1B vs GPipe " << name;
        }
      }
    }
  }
}

// Interleaved stages on one rank each run GPipe's arithmetic too: the interleaved run on S
// ranks is bitwise equal to GPipe on 2S ranks (the same 2S stages).
HP_DIST_TEST(PipelineSchedules, InterleavedIsBitwiseEqualToGPipeOnTwiceTheRanks, 4) {
  auto world = testing::world();
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  constexpr int64_t kMicrobatches = 4;
  const auto grads_of = [&](Kind kind, const GroupPtr& pp) {
    torch::manual_seed(42);
    Mlp whole(kIn, kDim, kHidden, kOut, 4 * kBlocksPerStage);
    RankStages mine = build(kind, whole, pp, kMicrobatches);
    const bool first = pp->rank() == 0, last = pp->rank() == pp->size() - 1;
    mine.schedule->step(first ? x : at::Tensor(), last ? y : at::Tensor());
    return stage_grads(mine);
  };
  const auto gpipe = grads_of(Kind::kGPipe, world->world_group());
  // Ranks 0 and 1 hold stages {0, 2} and {1, 3}: ranks 0, 2 and 1, 3 of GPipe.
  std::map<std::string, at::Tensor> interleaved;
  if (world->rank() < 2) {
    interleaved = grads_of(Kind::kInterleaved, world->new_group("interleaved", {0, 1}));
  }
  // GPipe ranks 2 and 3 send their gradients to the interleaved rank holding their stage.
  if (world->rank() >= 2) {
    for (const auto& [name, grad] : gpipe) {
      send(grad.contiguous(), world->rank() - 2, *world->world_group()).wait();
    }
    return;
  }
  for (const auto& [name, grad] : gpipe) {
    EXPECT_TRUE(torch::equal(interleaved.at(name), grad)) << name;
  }
  for (const auto& [name, grad] : interleaved) {
    if (gpipe.contains(name)) continue;
    at::Tensor received = at::empty_like(grad);
    recv(received, world->rank() + 2, *world->world_group()).wait();
    EXPECT_TRUE(torch::equal(received, grad)) << name;
  }
}

// 2 stages over `mesh` ({pp 2, data-parallel dims...}), each chunk fully_shard-ed over the
// data-parallel dims: 1F1B and interleaved against the reference on the global batch, one
// reduce-scatter per chunk and step.
void expect_stages_over_data_parallel_match(const DeviceMesh& mesh,
                                            const std::vector<std::string>& dp_dims) {
  int64_t dp = 0, dp_ranks = 1;
  for (const auto& dim : dp_dims) {
    dp = dp * mesh.size(dim) + mesh.coordinate(dim);
    dp_ranks *= mesh.size(dim);
  }
  const GroupPtr pp = mesh.group("pp");
  const bool first = pp->rank() == 0, last = pp->rank() == 1;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (Kind kind : {Kind::kOneFOneB, Kind::kInterleaved}) {
    SCOPED_TRACE(name_of(kind));
    const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1;
    torch::manual_seed(42);
    Mlp whole(kIn, kDim, kHidden, kOut, chunks * 2 * kBlocksPerStage);
    RankStages mine = build(kind, whole, pp, /*microbatches=*/2, mesh.slice(dp_dims));
    const Reference reference = reference_step(whole, chunks * 2, x, y);
    trace::start();
    const PipelineStepResult result =
        mine.schedule->step(first ? testing::local_batch(x, dp, dp_ranks) : at::Tensor(),
                            last ? testing::local_batch(y, dp, dp_ranks) : at::Tensor());
    int64_t reduce_scatters = 0;
    for (const auto& event : trace::stop()) {
      reduce_scatters += trace::describe(event).starts_with("RS issue");
    }
    EXPECT_EQ(reduce_scatters, chunks) << "one reduction per chunk and step";
    at::Tensor loss = last ? result.loss : at::zeros({});
    loss = testing::mean_over_ranks(loss) * 2;  // half of the ranks (the last stage's) hold one
    EXPECT_NEAR(loss.item<double>(), reference.loss.item<double>(), 1e-5) << "loss";
    for (const auto& [name, grad] : stage_grads(mine)) {
      EXPECT_TRUE(torch::allclose(grad, reference.grads.at(name), 0, 1e-5)) << name;
    }
    // This rank's loss averages over its share of the batch: its boundary gradients are
    // dp_ranks times its share of the global ones.
    for (int64_t v = 0; v < chunks; ++v) {
      const int64_t stage = v * 2 + pp->rank();
      const auto expect_boundary = [&](const at::Tensor& actual, int64_t boundary) {
        const at::Tensor expected =
            dp_ranks * testing::local_batch(reference.boundary_grads[boundary], dp, dp_ranks);
        EXPECT_TRUE(torch::allclose(actual, expected, 0, 1e-5)) << "boundary of stage " << boundary;
      };
      if (stage > 0) expect_boundary(result.input_grads[v], stage);
      if (stage < chunks * 2 - 1) expect_boundary(result.output_grads[v], stage + 1);
    }
  }
}

HP_DIST_TEST(PipelineSchedules, WithTwoFsdpRanksPerStage, 4) {
  expect_stages_over_data_parallel_match(DeviceMesh(testing::world(), {{"pp", 2}, {"dp_shard", 2}}),
                                         {"dp_shard"});
}

// HSDP inside each stage: mesh {pp 2, dp_replicate 2, dp_shard 2} on 8 ranks.
HP_DIST_TEST(PipelineSchedules, WithHsdpPerStage, 8) {
  expect_stages_over_data_parallel_match(
      DeviceMesh(testing::world(), {{"pp", 2}, {"dp_replicate", 2}, {"dp_shard", 2}}),
      {"dp_replicate", "dp_shard"});
}

// An MLP whose blocks are tensor-parallel (column then row) over `tp`; without a group, the
// plain model with the same parameters (tensor_parallel.h draws them whole).
struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl(int64_t blocks, const GroupPtr& tp)
      : input(register_module("input", torch::nn::Linear(kIn, kDim))) {
    for (int64_t i = 0; i < blocks; ++i) {
      const std::string n = std::to_string(i);
      up.push_back(register_module(
          "up" + n, ColumnParallelLinear(ColumnParallelLinearOptions{kDim, kHidden}, tp)));
      down.push_back(register_module(
          "down" + n, RowParallelLinear(RowParallelLinearOptions{kHidden, kDim}, tp)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kOut));
  }
  // Stage `stage` of `stages`: its blocks, with the input projection first and the head last.
  at::Tensor stage_forward(const at::Tensor& x, int64_t stage, int64_t stages) {
    const int64_t per_stage = static_cast<int64_t>(up.size()) / stages;
    at::Tensor h = stage == 0 ? input(x) : x;
    for (int64_t i = stage * per_stage; i < (stage + 1) * per_stage; ++i) {
      h = h + down[i](torch::tanh(up[i](h)));
    }
    return stage == stages - 1 ? head(h) : h;
  }
  torch::nn::Linear input, head{nullptr};
  std::vector<ColumnParallelLinear> up;
  std::vector<RowParallelLinear> down;
};
TORCH_MODULE(TpMlp);

// Tensor parallelism inside the stages: mesh {pp 2, tp 2}, 1F1B and interleaved; every
// gradient (each rank's slice of a split weight) within 1e-5 of the plain model's.
HP_DIST_TEST(PipelineSchedules, WithTensorParallelStages, 4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"pp", 2}, {"tp", 2}});
  const GroupPtr pp = mesh.group("pp"), tp = mesh.group("tp");
  const bool first = pp->rank() == 0, last = pp->rank() == 1;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (Kind kind : {Kind::kOneFOneB, Kind::kInterleaved}) {
    SCOPED_TRACE(name_of(kind));
    const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1, stages = 2 * chunks;
    torch::manual_seed(42);
    TpMlp model(stages * kBlocksPerStage, tp);
    torch::manual_seed(42);
    TpMlp reference(stages * kBlocksPerStage, nullptr);
    torch::mse_loss(reference->stage_forward(
                        [&] {
                          at::Tensor h = x;
                          for (int64_t s = 0; s + 1 < stages; ++s) {
                            h = reference->stage_forward(h, s, stages);
                          }
                          return h;
                        }(),
                        stages - 1, stages),
                    y)
        .backward();
    std::vector<PipelineStage> parts;
    for (int64_t v = 0; v < chunks; ++v) {
      const int64_t stage = v * 2 + pp->rank();
      parts.push_back({.forward =
                           [model, stage, stages](const at::Tensor& h) mutable {
                             return model->stage_forward(h, stage, stages);
                           },
                       .group = pp});
    }
    make_schedule(kind, std::move(parts), /*microbatches=*/4)
        ->step(first ? x : at::Tensor(), last ? y : at::Tensor());
    const auto expected = reference->named_parameters();
    int64_t compared = 0;
    for (const auto& item : model->named_parameters()) {
      if (!item.value().grad().defined()) continue;  // another rank's stage
      at::Tensor want = expected[item.key()].grad();
      if (auto slice = parallel_slice_of(item.value())) want = slice_of(want, *slice);
      EXPECT_TRUE(torch::allclose(item.value().grad(), want, 0, 1e-5)) << item.key();
      ++compared;
    }
    EXPECT_GT(compared, 0);
  }
}

// An MLP with a mixture-of-experts layer per stage, its experts split over `ep` (null:
// all local; the same parameters either way, expert_parallel.h draws them whole).
struct MoeMlpImpl : torch::nn::Module {
  MoeMlpImpl(int64_t stages, const GroupPtr& ep, double load_balance_coef = 0)
      : input(register_module("input", torch::nn::Linear(kIn, kDim))) {
    for (int64_t s = 0; s < stages; ++s) {
      moe.push_back(register_module("moe" + std::to_string(s),
                                    MoE(MoEOptions{.dim = kDim,
                                                   .expert_hidden = 16,
                                                   .num_experts = 4,
                                                   .top_k = 2,
                                                   .load_balance_coef = load_balance_coef},
                                        ep)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kOut));
  }
  at::Tensor stage_forward(const at::Tensor& x, int64_t stage) {
    at::Tensor h = stage == 0 ? input(x) : x;
    h = h + moe[stage](h);
    return stage == static_cast<int64_t>(moe.size()) - 1 ? head(h) : h;
  }
  torch::nn::Linear input, head{nullptr};
  std::vector<MoE> moe;
};
TORCH_MODULE(MoeMlp);

// Expert parallelism inside the stages: mesh {pp 2, ep 2}, the two ranks of a stage
// taking halves of the batch (data-parallel for the dense weights, whose gradients the
// test averages) and exchanging tokens with their experts in every microbatch's forward
// and backward; every gradient against the plain model on the global batch.
HP_DIST_TEST(PipelineSchedules, WithExpertParallelStages, 4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"pp", 2}, {"ep", 2}});
  const GroupPtr pp = mesh.group("pp"), ep = mesh.group("ep");
  const bool first = pp->rank() == 0, last = pp->rank() == 1;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  torch::manual_seed(42);
  MoeMlp model(2, ep);
  torch::manual_seed(42);
  MoeMlp reference(2, nullptr);
  torch::mse_loss(reference->stage_forward(reference->stage_forward(x, 0), 1), y).backward();
  const int64_t stage = pp->rank();
  OneFOneBSchedule schedule(
      {.forward = [model,
                   stage](const at::Tensor& h) mutable { return model->stage_forward(h, stage); },
       .group = pp},
      /*microbatches=*/2, testing::mse_loss);
  const int64_t half = ep->rank();
  schedule.step(first ? testing::local_batch(x, half, 2) : at::Tensor(),
                last ? testing::local_batch(y, half, 2) : at::Tensor());
  const auto expected = reference->named_parameters();
  int64_t experts = 0;
  for (const auto& item : model->named_parameters()) {
    at::Tensor grad = item.value().grad();
    if (!grad.defined()) continue;  // another stage's
    at::Tensor want = expected[item.key()].grad();
    if (auto slice = parallel_slice_of(item.value())) {
      // Each rank's loss is a mean over its half: the experts' gradient sums both halves'.
      want = slice_of(want, *slice) * 2;
      ++experts;
    } else {
      grad = grad.clone();
      all_reduce(grad, ReduceOp::kAvg, *ep).wait();
    }
    EXPECT_TRUE(torch::allclose(grad, want, 0, 1e-5)) << item.key();
  }
  EXPECT_EQ(experts, 3) << "w1, w3, w2 of this stage's experts";
}

// Each stage's own loss (its MoE layer's load balancing, PipelineStage::aux_loss) goes
// backward with its microbatch, weighted 1/M like the loss: the gradients are those of the
// mean over microbatches of the loss plus every stage's balancing loss, which the plain
// model computes microbatch by microbatch (the balancing loss is not linear in the batch).
// GPipe, 1F1B and interleaved alike; the step reports this rank's part of the balancing
// losses. A stage whose aux_loss is not a scalar is an error naming it.
HP_DIST_TEST(PipelineSchedules, StageAuxiliaryLossesGoBackwardWithTheirMicrobatch, 2) {
  auto world = testing::world();
  const GroupPtr pp = world->world_group();
  const int64_t ranks = pp->size(), rank = pp->rank();
  const bool first = rank == 0, last = rank == ranks - 1;
  constexpr int64_t kMicrobatches = 4;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  const std::vector<at::Tensor> xs = x.chunk(kMicrobatches), ys = y.chunk(kMicrobatches);
  for (Kind kind : {Kind::kGPipe, Kind::kOneFOneB, Kind::kInterleaved}) {
    SCOPED_TRACE(name_of(kind));
    const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1, stages = chunks * ranks;
    torch::manual_seed(42);
    MoeMlp model(stages, nullptr, /*load_balance_coef=*/0.5);
    torch::manual_seed(42);
    MoeMlp reference(stages, nullptr, /*load_balance_coef=*/0.5);
    double want_aux = 0;  // of this rank's stages
    for (int64_t m = 0; m < kMicrobatches; ++m) {
      at::Tensor h = xs[m], balancing = torch::zeros({});
      for (int64_t s = 0; s < stages; ++s) {
        h = reference->stage_forward(h, s);
        balancing = balancing + reference->moe[s]->aux_loss();
        if (s % ranks == rank) want_aux += reference->moe[s]->aux_loss().item<double>();
      }
      ((torch::mse_loss(h, ys[m]) + balancing) / kMicrobatches).backward();
    }
    want_aux /= kMicrobatches;

    std::vector<PipelineStage> parts;
    for (int64_t v = 0; v < chunks; ++v) {
      const int64_t stage = v * ranks + rank;
      parts.push_back(
          {.forward = [model, stage](
                          const at::Tensor& h) mutable { return model->stage_forward(h, stage); },
           .group = pp,
           .aux_loss = [model, stage] { return model->moe[stage]->aux_loss(); }});
    }
    const PipelineStepResult result = make_schedule(kind, std::move(parts), kMicrobatches)
                                          ->step(first ? x : at::Tensor(), last ? y : at::Tensor());
    EXPECT_NEAR(result.aux_loss.item<double>(), want_aux, 1e-6);
    const auto expected = reference->named_parameters();
    int64_t compared = 0;
    for (const auto& item : model->named_parameters()) {
      if (!item.value().grad().defined()) continue;  // another rank's stage
      EXPECT_TRUE(torch::allclose(item.value().grad(), expected[item.key()].grad(), 0, 1e-5))
          << item.key();
      ++compared;
    }
    EXPECT_EQ(compared, chunks * 4 + 2)
        << "router, w1, w3, w2 per stage; the input's or the head's weight and bias";
  }

  // On a pipeline of this rank alone, so that the error stops no peer mid-step.
  const GroupPtr alone = world->new_group("alone_" + std::to_string(rank), {rank});
  GPipeSchedule bad({.forward = [](const at::Tensor& h) { return h * 2; },
                     .group = alone,
                     .aux_loss = [] { return torch::zeros({2}); }},
                    1, testing::mse_loss);
  const std::string error = error_of([&] { bad.step(x, x * 2); });
  EXPECT_NE(error.find("stage 0's aux_loss gave a tensor of shape [2] after microbatch 0; it "
                       "must give a scalar"),
            std::string::npos)
      << error;
}

// The same with every chunk kept unsharded through the step (reshard after neither forward
// nor backward; the last backward reshards): one all-gather per chunk and step instead of
// one per forward and backward, the same gradients.
HP_DIST_TEST(PipelineSchedules, ChunksKeptUnshardedGatherOncePerStep, 4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}});
  const int64_t dp = mesh.coordinate("dp_shard");
  const GroupPtr pp = mesh.group("pp");
  const bool first = pp->rank() == 0, last = pp->rank() == 1;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  constexpr int64_t kMicrobatches = 4;
  std::map<bool, std::map<std::string, at::Tensor>> grads;
  std::map<bool, int64_t> all_gathers;
  for (bool keep : {false, true}) {
    torch::manual_seed(42);
    Mlp whole(kIn, kDim, kHidden, kOut, 2 * 2 * kBlocksPerStage);
    RankStages mine = build(Kind::kInterleaved, whole, pp, kMicrobatches, mesh.slice({"dp_shard"}));
    for (auto& fsdp : mine.fsdp) {
      fsdp->set_reshard_after_forward(!keep);
      fsdp->set_reshard_after_backward(!keep);
    }
    trace::start();
    mine.schedule->step(first ? testing::local_batch(x, dp, 2) : at::Tensor(),
                        last ? testing::local_batch(y, dp, 2) : at::Tensor());
    for (const auto& event : trace::stop()) {
      all_gathers[keep] += trace::describe(event).starts_with("AG issue");
    }
    for (auto& fsdp : mine.fsdp) {
      EXPECT_EQ(fsdp->is_unsharded(), keep);
      fsdp->reshard();
    }
    grads[keep] = stage_grads(mine);
  }
  std::printf("rank %lld: all-gathers per step %lld resharding, %lld kept unsharded\n",
              static_cast<long long>(world->rank()), static_cast<long long>(all_gathers[false]),
              static_cast<long long>(all_gathers[true]));
  EXPECT_EQ(all_gathers[true], 2) << "one per chunk";
  EXPECT_EQ(all_gathers[false], 2 * 2 * kMicrobatches) << "one per forward and backward";
  for (const auto& [name, grad] : grads[true]) {
    EXPECT_TRUE(torch::equal(grad, grads[false].at(name))) << name;
  }
}

std::vector<std::string> names_of(const std::vector<PipelineAction>& actions) {
  std::vector<std::string> names;
  for (const auto& action : actions) names.push_back(to_string(action));
  return names;
}

// A traced step on 4 stages runs each rank's table, which for 1F1B is the textbook one;
// every receive (but a chunk's first, which waits for the activation's shape) is posted
// before the action ahead of its own computes.
HP_DIST_TEST(PipelineSchedules, ATracedStepRunsTheTableWithReceivesPostedAhead, 4) {
  auto world = testing::world();
  const GroupPtr pp = world->world_group();
  const int64_t rank = pp->rank();
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  const std::vector<std::vector<std::string>> one_f_one_b = {
      {"F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F0.4", "B0.1", "F0.5", "B0.2", "F0.6", "B0.3",
       "F0.7", "B0.4", "B0.5", "B0.6", "B0.7"},
      {"F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "F0.4", "B0.2", "F0.5", "B0.3", "F0.6",
       "B0.4", "F0.7", "B0.5", "B0.6", "B0.7"},
      {"F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "F0.4", "B0.3", "F0.5", "B0.4",
       "F0.6", "B0.5", "F0.7", "B0.6", "B0.7"},
      {"F0.0", "B0.0", "F0.1", "B0.1", "F0.2", "B0.2", "F0.3", "B0.3", "F0.4", "B0.4", "F0.5",
       "B0.5", "F0.6", "B0.6", "F0.7", "B0.7"}};
  for (Kind kind : {Kind::kOneFOneB, Kind::kInterleaved}) {
    SCOPED_TRACE(name_of(kind));
    const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1;
    torch::manual_seed(42);
    Mlp whole(kIn, kDim, kHidden, kOut, chunks * 4 * kBlocksPerStage);
    RankStages mine = build(kind, whole, pp, /*microbatches=*/8);
    const std::vector<std::string> table = names_of(mine.schedule->actions());
    if (kind == Kind::kOneFOneB) EXPECT_EQ(table, one_f_one_b[rank]);
    EXPECT_EQ(table.size(), 16u * chunks);
    trace::start();
    mine.schedule->step(rank == 0 ? x : at::Tensor(), rank == 3 ? y : at::Tensor());
    std::vector<std::string> ran;
    std::map<std::string, size_t> posted, began;  // action -> its event's index
    const auto events = trace::stop();
    for (size_t i = 0; i < events.size(); ++i) {
      const std::string event = trace::describe(events[i]);
      const std::string action = event.substr(event.rfind(' ') + 1);
      if (event.starts_with("pp_forward begin ") || event.starts_with("pp_backward begin ")) {
        ran.push_back(action);
        began[action] = i;
      }
      if (event.starts_with("pp_recv issue ")) posted.emplace(action, i);
    }
    EXPECT_EQ(ran, table);
    size_t receives = 0;
    for (size_t i = 0; i < table.size(); ++i) {
      const PipelineAction& action = mine.schedule->actions()[i];
      const int64_t stage = action.chunk * 4 + rank;
      const bool receives_one =
          action.kind == PipelineAction::kForward ? stage > 0 : stage < chunks * 4 - 1;
      receives += receives_one;
      EXPECT_EQ(posted.contains(table[i]), receives_one) << table[i];
      // A chunk's first forward waits for the activation's shape before it can post.
      if (!receives_one || i == 0 ||
          (action.kind == PipelineAction::kForward && action.microbatch == 0)) {
        continue;
      }
      EXPECT_LT(posted[table[i]], began[table[i - 1]])
          << table[i] << "'s receive was not posted before " << table[i - 1] << " computed";
    }
    EXPECT_GT(receives, 0u);
  }
}

// The bytes a rank holds when each forward starts (counting allocator), with S = 2 ranks
// and M = 8 microbatches of 2-block stages: 1F1B holds the activations of S-1-r
// microbatches on rank r, GPipe of up to M-1, and interleaved (2 chunks of 2 blocks per
// rank) of its warm-up, (S-r-1)*2 + (V-1)*S chunk-microbatches.
HP_DIST_TEST(PipelineSchedules, EachScheduleHoldsTheActivationsItsTableSays, 2) {
  auto& probe = testing::CpuMemoryProbe::installed();
  auto world = testing::world();
  const GroupPtr pp = world->world_group();
  const int64_t rank = pp->rank(), ranks = pp->size();
  constexpr int64_t kMicrobatches = 8;
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({32, kIn}), y = torch::randn({32, kOut});
  const auto held_at_forwards = [&](Kind kind) {
    const int64_t chunks = kind == Kind::kInterleaved ? 2 : 1, stages = chunks * ranks;
    torch::manual_seed(42);
    // Wide blocks: their activations dwarf the boundary gradients a step keeps.
    Mlp whole(kIn, kDim, 8 * kHidden, kOut, stages * kBlocksPerStage);
    std::vector<int64_t> samples;
    int64_t baseline = 0;
    std::vector<PipelineStage> parts;
    for (int64_t v = 0; v < chunks; ++v) {
      Stage module(whole, v * ranks + rank, stages);
      parts.push_back({.forward =
                           [&, module](const at::Tensor& input) mutable {
                             samples.push_back(probe.live() - baseline);
                             return module(input);
                           },
                       .group = pp});
    }
    auto schedule = make_schedule(kind, std::move(parts), kMicrobatches);
    // A first step makes the gradients, which the measured one accumulates into.
    schedule->step(rank == 0 ? x : at::Tensor(), rank == 1 ? y : at::Tensor());
    samples.clear();
    baseline = probe.settled_live();
    schedule->step(rank == 0 ? x : at::Tensor(), rank == 1 ? y : at::Tensor());
    return samples;
  };
  const std::vector<int64_t> gpipe = held_at_forwards(Kind::kGPipe);
  const std::vector<int64_t> one_f_one_b = held_at_forwards(Kind::kOneFOneB);
  const std::vector<int64_t> interleaved = held_at_forwards(Kind::kInterleaved);
  ASSERT_EQ(gpipe.size(), static_cast<size_t>(kMicrobatches));
  ASSERT_EQ(one_f_one_b.size(), static_cast<size_t>(kMicrobatches));
  ASSERT_EQ(interleaved.size(), static_cast<size_t>(2 * kMicrobatches));
  // One microbatch's activations (2 blocks): what GPipe holds more at its second forward
  // than at its first.
  const int64_t one = gpipe[1] - gpipe[0];
  const auto most = [](const std::vector<int64_t>& v) {
    return *std::max_element(v.begin(), v.end()) - v.front();
  };
  const int64_t warmup = ranks - 1 - rank;
  const int64_t interleaved_warmup = (ranks - rank - 1) * 2 + ranks;
  std::printf(
      "rank %lld: one microbatch %lld bytes; held at a forward: GPipe up to %lld, 1F1B up "
      "to %lld (warm-up %lld), interleaved up to %lld (warm-up %lld)\n",
      static_cast<long long>(rank), static_cast<long long>(one),
      static_cast<long long>(most(gpipe)), static_cast<long long>(most(one_f_one_b)),
      static_cast<long long>(warmup), static_cast<long long>(most(interleaved)),
      static_cast<long long>(interleaved_warmup));
  ASSERT_GT(one, 8 * 1024) << "the activations dominate the bytes held";
  EXPECT_GE(most(gpipe), (kMicrobatches - 1) * one * 9 / 10);
  // The boundary gradients a step returns stay too: a few KiB.
  EXPECT_LE(most(one_f_one_b), warmup * one + one / 2);
  EXPECT_LE(most(interleaved), interleaved_warmup * one + one / 2);
  EXPECT_GE(most(interleaved), (interleaved_warmup - 1) * one);
}

}  // namespace
}  // namespace hp
