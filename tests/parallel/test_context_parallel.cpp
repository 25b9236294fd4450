// Context parallelism (include/hyperparallel/context_parallel.h), alone and composed with
// fully_shard, against the single-process computation of the whole sequence: the
// sequence layouts, the differentiable gather, causal attention over a split sequence
// (output and q/k/v gradients, 1e-6), the decoder of models/transformer.h on
// cp 2 x dp_shard 2 and on cp 4 (loss, grad norm, every gradient and parameter over two
// AdamW steps, 1e-5; a bitwise rerun) and the errors for sequences that do not divide.
// Rank 0 prints the largest differences seen (run a body under hp-run to read them).
#include <torch/torch.h>

#include <cstdio>
#include <cstring>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/context_parallel.h"
#include "models/transformer.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;
using testing::error_of;

const ContextParallelOptions kContiguous{.layout = SequenceLayout::kContiguous};
const ContextParallelOptions kLoadBalanced{.layout = SequenceLayout::kLoadBalanced};

std::string name_of(const ContextParallelOptions& options) {
  return options.layout == SequenceLayout::kContiguous ? "contiguous" : "load-balanced";
}

using testing::max_abs_diff;

bool is_rank_zero() { return testing::world()->rank() == 0; }

// The global positions rank r of cp holds, written out from the layouts' definitions.
std::vector<int64_t> expected_positions(int64_t seq, int64_t rank, int64_t cp,
                                        SequenceLayout layout) {
  std::vector<int64_t> positions;
  auto append = [&](int64_t first, int64_t count) {
    for (int64_t p = first; p < first + count; ++p) positions.push_back(p);
  };
  if (layout == SequenceLayout::kContiguous) {
    append(rank * (seq / cp), seq / cp);
  } else {
    const int64_t chunk = seq / (2 * cp);
    append(rank * chunk, chunk);
    append((2 * cp - 1 - rank) * chunk, chunk);
  }
  return positions;
}

HP_DIST_TEST(ContextParallel, LayoutsHoldTheDocumentedChunks, 1, 2, 4) {
  auto world = testing::world();
  const GroupPtr& cp = world->world_group();
  const int64_t seq = 16;
  torch::manual_seed(0);  // the same global tensors on every rank
  for (const auto& options : {kContiguous, kLoadBalanced}) {
    SCOPED_TRACE(name_of(options));
    at::Tensor positions = sequence_positions(seq, cp, options);
    std::vector<int64_t> got(positions.data_ptr<int64_t>(),
                             positions.data_ptr<int64_t>() + positions.numel());
    EXPECT_EQ(got, expected_positions(seq, cp->rank(), cp->size(), options.layout));
    // shard_sequence puts the tokens where sequence_positions says they are, along any dim.
    at::Tensor tokens = torch::arange(seq).repeat({3, 1});  // [B, T]
    EXPECT_TRUE(torch::equal(shard_sequence(tokens, cp, options), positions.expand({3, -1})));
    at::Tensor hidden = torch::randn({2, seq, 5});
    at::Tensor local = shard_sequence(hidden, cp, options);
    EXPECT_TRUE(torch::equal(local, hidden.index_select(1, positions)));
    EXPECT_TRUE(torch::equal(unshard_sequence(local, cp, options), hidden));
    at::Tensor last_dim = torch::randn({3, seq});
    EXPECT_TRUE(torch::equal(
        unshard_sequence(shard_sequence(last_dim, cp, options, -1), cp, options, -1), last_dim));
  }
  // Causal work of a rank: keys seen by its queries. Load balancing makes it equal.
  at::Tensor work = (sequence_positions(seq, cp, kLoadBalanced) + 1).sum();
  at::Tensor most = work.clone(), least = work.clone();
  all_reduce(most, ReduceOp::kMax, *cp).wait();
  all_reduce(least, ReduceOp::kMin, *cp).wait();
  EXPECT_EQ(most.item<int64_t>(), least.item<int64_t>());
}

HP_DIST_TEST(ContextParallel, GatherAlongDimConcatenatesAndSumsGradients, 1, 2, 3) {
  auto world = testing::world();
  const GroupPtr& group = world->world_group();
  const int64_t ranks = group->size(), rank = group->rank();
  auto part_of = [](int64_t r) { return torch::arange(24, at::kFloat).view({2, 3, 4}) + 100 * r; };
  for (int64_t dim : {0, 1, 2, -1}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    at::Tensor local = part_of(rank).requires_grad_();
    at::Tensor gathered = gather_along_dim(local, dim, group);
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < ranks; ++r) parts.push_back(part_of(r));
    at::Tensor whole = torch::cat(parts, dim);
    EXPECT_TRUE(torch::equal(gathered, whole));
    // Rank r weighs the gathered tensor by (r + 1) x base: the gradient of a part is the
    // base's slice of that part times 1 + 2 + ... + ranks. In place where the gather made
    // a new tensor (an ordinary one: autograd allows it); on 1 rank it returns `local`.
    at::Tensor base = torch::arange(whole.numel(), at::kFloat).view(whole.sizes());
    at::Tensor weights = base * double(rank + 1);
    (ranks > 1 ? gathered.mul_(weights) : gathered * weights).sum().backward();
    const int64_t len = local.size(dim);
    at::Tensor expected = base.narrow(dim, rank * len, len) * double(ranks * (ranks + 1) / 2);
    EXPECT_TRUE(torch::equal(local.grad(), expected));
  }
}

// Causal attention of the whole sequence, as models/transformer.h computes it.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t seq = q.size(2);
  at::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(3)));
  at::Tensor future = torch::ones({seq, seq}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(scores, -1, at::kFloat), v);
}

HP_DIST_TEST(ContextParallel, AttentionMatchesSingleProcessCausalAttention, 1, 2, 4) {
  auto world = testing::world();
  const GroupPtr& cp = world->world_group();
  for (const auto& options : {kContiguous, kLoadBalanced}) {
    SCOPED_TRACE(name_of(options));
    torch::manual_seed(3);
    auto input = [] { return torch::randn({2, 3, 16, 8}).requires_grad_(); };  // [B, H, T, hd]
    at::Tensor q = input(), k = input(), v = input();
    at::Tensor out_weight = torch::randn({2, 3, 16, 8});  // makes every output count
    at::Tensor reference = causal_attention(q, k, v);
    (reference * out_weight).sum().backward();

    auto local_leaf = [&](const at::Tensor& t) {
      return shard_sequence(t.detach(), cp, options, /*seq_dim=*/2).requires_grad_();
    };
    at::Tensor local_q = local_leaf(q), local_k = local_leaf(k), local_v = local_leaf(v);
    at::Tensor out = context_parallel_attention(local_q, local_k, local_v, cp, options);
    ASSERT_EQ(out.sizes(), local_q.sizes());
    (out * shard_sequence(out_weight, cp, options, 2)).sum().backward();

    auto local_of = [&](const at::Tensor& t) { return shard_sequence(t, cp, options, 2); };
    const double out_diff = max_abs_diff(out, local_of(reference.detach()));
    const double whole_diff =
        max_abs_diff(unshard_sequence(out.detach(), cp, options, 2), reference.detach());
    const double q_diff = max_abs_diff(local_q.grad(), local_of(q.grad()));
    const double k_diff = max_abs_diff(local_k.grad(), local_of(k.grad()));
    const double v_diff = max_abs_diff(local_v.grad(), local_of(v.grad()));
    EXPECT_LE(out_diff, 1e-6) << "output";
    EXPECT_LE(whole_diff, 1e-6) << "unsharded output";
    EXPECT_LE(q_diff, 1e-6) << "q grad";
    EXPECT_LE(k_diff, 1e-6) << "k grad";
    EXPECT_LE(v_diff, 1e-6) << "v grad";
    if (is_rank_zero()) {
      std::printf(
          "attention cp %lld %s: max diff output %.3g, q grad %.3g, k grad %.3g, "
          "v grad %.3g\n",
          (long long)cp->size(), name_of(options).c_str(), out_diff, q_diff, k_diff, v_diff);
    }
  }
}

TransformerConfig small_decoder() {
  return {.vocab = 64, .dim = 64, .heads = 4, .layers = 2, .ffn_hidden = 128, .max_seq = 32};
}

using testing::StepResult;

// Where the decoder runs: its sequence split over `cp`, its batch rows over `dp_size`
// data-parallel ranks (this one `dp_rank`), fully_shard-ed over `fsdp_mesh`.
struct Parallelism {
  GroupPtr cp;
  ContextParallelOptions cp_options;
  int64_t dp_rank = 0, dp_size = 1;
  DeviceMesh fsdp_mesh;
};

// Two AdamW steps of the decoder on a global batch of 4 x 32 tokens. With
// check_reference, also the single-process model on the whole global batch, compared
// after each backward (mean loss over all ranks, grad norm, every gradient) and after
// each step (every parameter) within 1e-5.
std::vector<StepResult> train(const Parallelism& parallel, bool check_reference) {
  TransformerConfig config = small_decoder();
  const int64_t seq = config.max_seq, global_batch = 4;
  Transformer reference{nullptr};
  if (check_reference) {
    torch::manual_seed(42);
    reference = Transformer(config);
  }
  config.context_parallel = parallel.cp;
  config.context_parallel_options = parallel.cp_options;
  torch::manual_seed(42);
  Sharded<Transformer> model(config);
  testing::ShardedParts parts = testing::shard_blocks_then_root(model->layers, model, "layers.",
                                                                {.mesh = parallel.fsdp_mesh});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::optional<torch::optim::AdamW> ref_opt;
  if (check_reference) ref_opt.emplace(reference->parameters(), torch::optim::AdamWOptions(1e-3));

  // This rank's rows of the batch, then its part of their sequence.
  auto local_part = [&](const at::Tensor& global) {
    at::Tensor rows = testing::local_batch(global, parallel.dp_rank, parallel.dp_size);
    return shard_sequence(rows, parallel.cp, parallel.cp_options);
  };
  std::vector<StepResult> results;
  double loss_diff = 0, norm_diff = 0, grad_diff = 0, param_diff = 0;
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(config.vocab, {global_batch, seq + 1});
    at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);
    opt.zero_grad();
    // Mean over this rank's tokens: every rank has as many, so the average over the
    // dp x cp ranks (fully_shard's reduction, and mean_over_ranks) is the global mean.
    at::Tensor loss = testing::token_cross_entropy(model(local_part(input)), local_part(target));
    loss.backward();
    at::Tensor mean_loss = testing::mean_over_ranks(loss);
    auto grads = testing::full_grads(parts);
    results.push_back({mean_loss.item<float>(), static_cast<float>(testing::norm_of(grads))});
    if (check_reference) {
      const testing::ReferenceStepDiffs diffs = testing::expect_reference_step_matches(
          reference, input, target, mean_loss.item<double>(), grads, 1e-5);
      loss_diff = std::max(loss_diff, diffs.loss);
      norm_diff = std::max(norm_diff, diffs.grad_norm);
      grad_diff = std::max(grad_diff, diffs.grad);
      ref_opt->step();
    }
    opt.step();
    if (check_reference) {
      auto params = testing::full_params(parts), ref_params = testing::reference_params(*reference);
      testing::expect_all_close(params, ref_params, 1e-5, "param after step");
      param_diff = std::max(param_diff, max_abs_diff(params, ref_params));
    }
  }
  if (check_reference && is_rank_zero()) {
    std::printf(
        "decoder cp %lld x dp %lld %s: max diff loss %.3g, grad norm %.3g, grad %.3g, "
        "param %.3g\n",
        (long long)parallel.cp->size(), (long long)parallel.dp_size,
        name_of(parallel.cp_options).c_str(), loss_diff, norm_diff, grad_diff, param_diff);
  }
  return results;
}

// The model is replicated over cp, so fully_shard reduces over dp_shard x cp: a 1-D mesh
// over those 4 ranks.
HP_DIST_TEST(ContextParallel, DecoderCp2TimesFsdp2MatchesSingleProcess, 4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"dp_shard", 2}, {"cp", 2}});
  DeviceMesh dp_cp(world, {{"dp_cp", 4}});
  for (const auto& options : {kLoadBalanced, kContiguous}) {
    SCOPED_TRACE(name_of(options));
    const Parallelism parallel{.cp = mesh.group("cp"),
                               .cp_options = options,
                               .dp_rank = mesh.coordinate("dp_shard"),
                               .dp_size = mesh.size("dp_shard"),
                               .fsdp_mesh = dp_cp};
    auto first = train(parallel, /*check_reference=*/true);
    if (options.layout == SequenceLayout::kLoadBalanced) {
      testing::expect_bitwise_equal(first, train(parallel, /*check_reference=*/false));
    }
  }
}

HP_DIST_TEST(ContextParallel, DecoderCp4FsdpOverCpMatchesSingleProcess, 4) {
  DeviceMesh mesh(testing::world(), {{"cp", 4}});
  for (const auto& options : {kLoadBalanced, kContiguous}) {
    SCOPED_TRACE(name_of(options));
    train({.cp = mesh.group("cp"), .cp_options = options, .fsdp_mesh = mesh},
          /*check_reference=*/true);
  }
}

HP_DIST_TEST(ContextParallel, BadInputIsExplained, 2) {
  auto world = testing::world();
  const GroupPtr& cp = world->world_group();
  auto has = [](const std::string& message, const std::vector<std::string>& parts) {
    for (const auto& part : parts) {
      if (message.find(part) == std::string::npos) return ::testing::AssertionFailure() << message;
    }
    return ::testing::AssertionSuccess();
  };
  at::Tensor tokens30 = torch::zeros({2, 30}, at::kLong);
  EXPECT_TRUE(has(error_of([&] { shard_sequence(tokens30, cp, kLoadBalanced); }),
                  {"hp::shard_sequence", "sequence length 30", "not divisible by 2 x cp = 4",
                   "multiple of 4", "SequenceLayout::kContiguous"}));
  EXPECT_TRUE(has(error_of([&] {
                    shard_sequence(torch::zeros({2, 31}), cp, kContiguous);
                  }),
                  {"sequence length 31", "not divisible by cp = 2", "multiple of 2"}));
  EXPECT_TRUE(has(error_of([&] { sequence_positions(30, cp, kLoadBalanced); }),
                  {"hp::sequence_positions", "sequence length 30", "2 x cp = 4"}));
  at::Tensor odd = torch::zeros({1, 2, 3, 4});  // 3 local tokens cannot be 2 equal chunks
  EXPECT_TRUE(has(error_of([&] { context_parallel_attention(odd, odd, odd, cp, kLoadBalanced); }),
                  {"hp::context_parallel_attention", "3 tokens", "must be even"}));
  EXPECT_TRUE(has(error_of([&] { unshard_sequence(odd, cp, kLoadBalanced, 2); }),
                  {"hp::unshard_sequence", "3 tokens"}));
  EXPECT_TRUE(has(error_of([&] {
                    context_parallel_attention(torch::zeros({1, 2, 4, 4}),
                                               torch::zeros({1, 2, 2, 4}),
                                               torch::zeros({1, 2, 4, 4}), cp);
                  }),
                  {"q, k and v must all be", "k [1, 2, 2, 4]"}));
  EXPECT_TRUE(
      has(error_of([&] { shard_sequence(tokens30, nullptr); }), {"no context-parallel group"}));
  EXPECT_TRUE(has(error_of([&] { gather_along_dim(tokens30, 2, cp); }),
                  {"hp::gather_along_dim", "dim 2 is out of range", "2 dims"}));
  // The decoder: 3 tokens per rank make 6, which the load-balanced layout cannot cut into
  // 4 chunks; 20 per rank make 40, more than max_seq.
  TransformerConfig config = small_decoder();
  config.context_parallel = cp;
  Transformer model(config);
  EXPECT_TRUE(has(error_of([&] {
                    model(torch::zeros({1, 3}, at::kLong));
                  }),
                  {"sequence length 6", "2 x cp = 4"}));
  EXPECT_TRUE(has(error_of([&] {
                    model(torch::zeros({1, 20}, at::kLong));
                  }),
                  {"sequence length 40 exceeds max_seq 32"}));
}

}  // namespace
}  // namespace hp
