// Tensor parallelism: each layer against its plain LibTorch counterpart (bitwise without
// a group, 1e-6 split over 2 and 4 ranks), and the decoder with 2 TP x 2 FSDP against the
// single-process model on the global batch (loss, grad norm, every gradient, clipping,
// parameters after AdamW, full state dicts); with quantized collectives and error feedback
// it trains close to full precision and resumes from a checkpoint bit for bit.
#include <torch/torch.h>

#include <cstring>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/clip_grad.h"
#include "hyperparallel/comm_codec.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "hyperparallel/tensor_parallel.h"
#include "models/transformer.h"
#include "shared_dir.h"

namespace hp {
namespace {

using models::Transformer;
using models::TransformerConfig;

using testing::max_abs_diff;

// The whole gradient of a tensor-parallel layer's parameter (itself when not a slice).
at::Tensor whole_grad(const at::Tensor& param) {
  auto slice = parallel_slice_of(param);
  return slice ? join_parallel_slices(param.grad(), *slice) : param.grad();
}

TEST(TensorParallel, WithoutAGroupTheLayersArePlainLibTorch) {
  torch::manual_seed(3);
  torch::nn::Linear linear(torch::nn::LinearOptions(8, 12));
  torch::nn::Embedding embedding(16, 8);
  torch::manual_seed(3);
  ColumnParallelLinear column(ColumnParallelLinearOptions{.in_features = 8, .out_features = 12});
  VocabParallelEmbedding vocab(16, 8);
  torch::manual_seed(3);
  RowParallelLinear row(RowParallelLinearOptions{.in_features = 8, .out_features = 12});
  EXPECT_TRUE(torch::equal(column->weight, linear->weight));
  EXPECT_TRUE(torch::equal(column->bias, linear->bias));
  EXPECT_TRUE(torch::equal(row->weight, linear->weight));
  EXPECT_TRUE(torch::equal(row->bias, linear->bias));
  EXPECT_TRUE(torch::equal(vocab->weight, embedding->weight));
  at::Tensor x = torch::randn({3, 8});
  EXPECT_TRUE(torch::equal(column(x), linear(x)));
  EXPECT_TRUE(torch::equal(row(x), linear(x)));
  at::Tensor tokens = torch::randint(16, {2, 5});
  EXPECT_TRUE(torch::equal(vocab(tokens), embedding(tokens)));
  EXPECT_FALSE(parallel_slice_of(column->weight).has_value());
  at::Tensor logits = torch::randn({6, 16}), target = torch::randint(16, {6});
  EXPECT_TRUE(torch::equal(vocab_parallel_cross_entropy(logits, target, nullptr),
                           torch::nn::functional::cross_entropy(logits, target)));
}

// Column (gathered or not) and row layers, the embedding and the loss over all ranks vs
// the plain layers on one process, forward and backward.
HP_DIST_TEST(TensorParallel, LayersMatchTheirPlainCounterparts, 2, 4) {
  const GroupPtr& tp = testing::world()->world_group();
  const int64_t n = tp->size();
  torch::manual_seed(11);
  torch::nn::Linear up(torch::nn::LinearOptions(8, 4 * n)),
      down(torch::nn::LinearOptions(4 * n, 8));
  torch::nn::Linear gathered_ref(torch::nn::LinearOptions(8, 2 * n));
  torch::nn::Linear split_ref(torch::nn::LinearOptions(2 * n, 6));
  torch::nn::Embedding embedding_ref(4 * n, 8);
  torch::manual_seed(11);
  ColumnParallelLinear column(ColumnParallelLinearOptions{.in_features = 8, .out_features = 4 * n},
                              tp);
  RowParallelLinear row(RowParallelLinearOptions{.in_features = 4 * n, .out_features = 8}, tp);
  ColumnParallelLinear gathered(
      ColumnParallelLinearOptions{.in_features = 8, .out_features = 2 * n, .gather_output = true},
      tp);
  RowParallelLinear split(
      RowParallelLinearOptions{.in_features = 2 * n, .out_features = 6, .input_is_parallel = false},
      tp);
  VocabParallelEmbedding embedding(4 * n, 8, tp);

  torch::manual_seed(5);
  at::Tensor tokens = torch::randint(4 * n, {3, 5});
  at::Tensor target = torch::randint(4 * n, {15});
  at::Tensor x_ref = embedding_ref(tokens);
  at::Tensor x = embedding(tokens);
  EXPECT_LE(max_abs_diff(x, x_ref), 1e-6) << "embedding";

  // MLP: column -> relu -> row; a gathered column; a row taking the whole input; the
  // tied output projection and the vocab-parallel loss.
  at::Tensor y_ref = down(torch::relu(up(x_ref)));
  at::Tensor y = row(torch::relu(column(x)));
  EXPECT_LE(max_abs_diff(y, y_ref), 1e-6) << "column -> row";
  at::Tensor g_ref = gathered_ref(x_ref), g = gathered(x);
  EXPECT_LE(max_abs_diff(g, g_ref), 1e-6) << "gathered column";
  at::Tensor s_ref = split_ref(g_ref), s = split(g);
  EXPECT_LE(max_abs_diff(s, s_ref), 1e-6) << "row from the whole input";
  at::Tensor logits_ref = torch::nn::functional::linear(y_ref, embedding_ref->weight);
  at::Tensor logits =
      torch::nn::functional::linear(copy_to_tensor_parallel(y, tp), embedding->weight);
  at::Tensor loss_ref = torch::nn::functional::cross_entropy(logits_ref.reshape({15, -1}), target) +
                        s_ref.pow(2).mean();
  at::Tensor loss =
      vocab_parallel_cross_entropy(logits.reshape({15, -1}), target, tp) + s.pow(2).mean();
  EXPECT_LE(max_abs_diff(loss, loss_ref), 1e-6) << "loss";
  loss_ref.backward();
  loss.backward();

  EXPECT_LE(max_abs_diff(whole_grad(column->weight), up->weight.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(whole_grad(column->bias), up->bias.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(whole_grad(row->weight), down->weight.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(row->bias.grad(), down->bias.grad()), 1e-6) << "replicated bias";
  EXPECT_LE(max_abs_diff(whole_grad(gathered->weight), gathered_ref->weight.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(whole_grad(split->weight), split_ref->weight.grad()), 1e-6);
  EXPECT_LE(max_abs_diff(whole_grad(embedding->weight), embedding_ref->weight.grad()), 1e-6);
  EXPECT_FALSE(parallel_slice_of(row->bias).has_value());
  EXPECT_EQ(parallel_slice_of(row->weight)->dim, 1);
}

HP_DIST_TEST(TensorParallel, SizesThatDoNotSplitAreExplained, 2) {
  const GroupPtr& tp = testing::world()->world_group();
  EXPECT_NE(testing::error_of([&] {
              ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = 4, .out_features = 5},
                                   tp);
            })
                .find("ColumnParallelLinear: out_features (5) must be divisible by the "
                      "tensor-parallel group size (2)"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              RowParallelLinear(RowParallelLinearOptions{.in_features = 3, .out_features = 4}, tp);
            }).find("in_features (3)"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { VocabParallelEmbedding(7, 4, tp); }).find("vocab (7)"),
            std::string::npos);
  TransformerConfig config{.heads = 3, .tensor_parallel = tp};
  config.dim = 48;
  EXPECT_NE(testing::error_of([&] {
              config.validate();
            }).find("heads (3) must be divisible by the tensor-parallel size (2)"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              vocab_parallel_cross_entropy(torch::zeros({2, 4}), torch::tensor({0, 8}), tp);
            }).find("target ids must lie in [0, 8)"),
            std::string::npos);
  // fully_shard over the tensor-parallel ranks themselves would mix different slices.
  Sharded<Transformer> model(TransformerConfig{.dim = 32, .tensor_parallel = tp});
  EXPECT_NE(testing::error_of([&] {
              fully_shard(model->layers[0]);
            }).find("parameter 'attn.wq.weight' is a parallel slice over group 'world'"),
            std::string::npos);
}

TransformerConfig decoder_config(GroupPtr tensor_parallel) {
  return {.vocab = 64,
          .dim = 32,
          .heads = 4,
          .layers = 2,
          .ffn_hidden = 48,
          .max_seq = 16,
          .tensor_parallel = std::move(tensor_parallel)};
}

using testing::StepResult;

// Two AdamW steps of the decoder, 2 TP x 2 FSDP on {dp_shard 2, tp 2}, with clipping;
// with `check_reference` compared on the way with the single-process model on the global
// batch (everything within 1e-5).
std::vector<StepResult> train_tp_fsdp(bool check_reference, const std::string& checkpoint_dir) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
  const GroupPtr& tp = mesh.group("tp");
  const int64_t dp_rank = mesh.coordinate("dp_shard");
  Transformer reference{nullptr};
  if (check_reference) {
    torch::manual_seed(42);
    reference = Transformer(decoder_config(nullptr));
  }
  torch::manual_seed(42);
  Sharded<Transformer> model(decoder_config(tp));
  FullyShardOptions options;
  options.mesh = mesh.slice({"dp_shard"});
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->layers, model, "layers.", options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  std::optional<torch::optim::AdamW> ref_opt;
  if (check_reference) ref_opt.emplace(reference->parameters(), torch::optim::AdamWOptions(1e-2));

  std::vector<StepResult> results;
  const int64_t seq = 16, vocab = 64;
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = torch::randint(vocab, {4, seq + 1});
    at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);
    opt.zero_grad();
    at::Tensor logits = model(testing::local_batch(input, dp_rank, 2));
    EXPECT_EQ(logits.size(-1), vocab / 2) << "this rank's vocabulary slice";
    at::Tensor loss =
        vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                     testing::local_batch(target, dp_rank, 2).reshape(-1), tp);
    loss.backward();
    at::Tensor mean_loss = testing::mean_over_ranks(loss);
    auto grads = testing::full_grads(parts);
    const double norm = clip_grad_norm_(model->parameters(), 0.5);
    results.push_back({mean_loss.item<float>(), static_cast<float>(norm)});
    if (check_reference) {
      testing::expect_reference_step_matches(reference, input, target, mean_loss.item<double>(),
                                             grads, 1e-5);
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
      EXPECT_NEAR(norm, ref_norm, 1e-5) << "clip_grad_norm_ counts each slice once";
      const auto clipped = testing::full_grads(parts);
      testing::expect_all_close(clipped, testing::reference_grads(*reference), 1e-5,
                                "clipped grad");
      // The reference steps on the (checked) gradients of the parallel model. AdamW moves
      // a parameter by up to lr whatever its gradient's size, so gradients at rounding
      // level (summed in another order on one process) would leave the parameters up to
      // 4e-5 apart (measured on AMD EPYC) and compare the optimizers on different inputs.
      torch::NoGradGuard no_grad;
      for (auto& item : reference->named_parameters()) {
        const at::Tensor& grad = clipped.at(item.key());
        if (grad.defined()) item.value().mutable_grad().copy_(grad);
      }
      ref_opt->step();
    }
    opt.step();
  }
  if (check_reference) {
    testing::expect_all_close(testing::full_params(parts), testing::reference_params(*reference),
                              1e-5, "param after 2 steps");
    // Full state dicts hold whole tensors, named as in the single-process model; a fresh
    // tensor-parallel model loads them back slice by slice.
    StateDict full = get_full_state_dict(*model);
    std::map<std::string, at::Tensor> saved;
    for (const auto& item : full) saved[item.key()] = item.value();
    testing::expect_all_close(saved, testing::reference_params(*reference), 1e-5, "state dict");
    torch::manual_seed(1);
    Sharded<Transformer> fresh(decoder_config(tp));
    testing::ShardedParts fresh_parts =
        testing::shard_blocks_then_root(fresh->layers, fresh, "layers.", options);
    set_full_state_dict(*fresh, full);
    testing::expect_all_close(testing::full_params(fresh_parts),
                              testing::reference_params(*reference), 1e-5, "loaded");
    // A sharded checkpoint: each rank writes its shard of its slice; loaded into a fresh
    // model it gives the same parameters and optimizer state.
    save_sharded_checkpoint(checkpoint_dir, *model, &opt);
    torch::manual_seed(2);
    Sharded<Transformer> restored(decoder_config(tp));
    testing::ShardedParts restored_parts =
        testing::shard_blocks_then_root(restored->layers, restored, "layers.", options);
    torch::optim::AdamW restored_opt(restored->parameters(), torch::optim::AdamWOptions(1e-2));
    load_sharded_checkpoint(checkpoint_dir, *restored, &restored_opt);
    testing::expect_all_close(testing::full_params(restored_parts),
                              testing::reference_params(*reference), 1e-5, "restored");
    StateDict optim = get_full_optimizer_state_dict(*model, opt);
    StateDict restored_optim = get_full_optimizer_state_dict(*restored, restored_opt);
    std::map<std::string, at::Tensor> a, b;
    for (const auto& item : optim) a[item.key()] = item.value();
    for (const auto& item : restored_optim) b[item.key()] = item.value();
    EXPECT_EQ(a.size(), b.size());
    testing::expect_all_close(b, a, 0.0, "restored optimizer state");
  }
  return results;
}

HP_DIST_TEST_WITH_TIMEOUT(TensorParallel, DecoderTpTimesFsdpMatchesSingleProcess, 300, 4) {
  const std::string dir = testing::shared_dir("hp_tp_fsdp");
  auto first = train_tp_fsdp(/*check_reference=*/true, dir + "/checkpoint");
  auto second = train_tp_fsdp(/*check_reference=*/false, "");
  testing::expect_bitwise_equal(first, second);
  testing::remove_after_all_ranks(dir);
}

// int8 all-gathers and reduce-scatters with error feedback inside 2 TP x 2 FSDP: the losses
// stay within 3% of full precision's, and a sharded checkpoint, which keeps each rank's
// residuals of its own slices, resumes the run bit for bit.
HP_DIST_TEST_WITH_TIMEOUT(TensorParallel, QuantizedCollectivesWithErrorFeedbackResumeBitwise, 300,
                          4) {
  auto world = testing::world();
  DeviceMesh mesh(world, {{"dp_shard", 2}, {"tp", 2}});
  const GroupPtr& tp = mesh.group("tp");
  const int64_t dp_rank = mesh.coordinate("dp_shard");
  const std::string dir = testing::shared_dir("hp_tp_codecs");
  struct Run {
    Sharded<Transformer> model{nullptr};
    std::unique_ptr<torch::optim::AdamW> opt;
  };
  const auto make = [&](const CommPolicy& policy) {
    torch::manual_seed(42);
    Run run{Sharded<Transformer>(decoder_config(tp)), nullptr};
    FullyShardOptions options;
    options.mesh = mesh.slice({"dp_shard"});
    options.comm_policy = policy;
    testing::shard_blocks_then_root(run.model->layers, run.model, "layers.", options);
    run.opt = std::make_unique<torch::optim::AdamW>(run.model->parameters(),
                                                    torch::optim::AdamWOptions(1e-2));
    return run;
  };
  const auto steps = [&](Run& run, int first, int count) {
    std::vector<double> losses;
    for (int step = first; step < first + count; ++step) {
      torch::manual_seed(100 + step);
      at::Tensor tokens = torch::randint(64, {4, 17});
      at::Tensor input = tokens.narrow(1, 0, 16), target = tokens.narrow(1, 1, 16);
      run.opt->zero_grad();
      at::Tensor logits = run.model(testing::local_batch(input, dp_rank, 2));
      at::Tensor loss =
          vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                       testing::local_batch(target, dp_rank, 2).reshape(-1), tp);
      loss.backward();
      run.opt->step();
      losses.push_back(testing::mean_over_ranks(loss).item<double>());
    }
    return losses;
  };
  const CommPolicy int8 = {.all_gather_codec = CommCodec::kInt8,
                           .reduce_scatter_codec = CommCodec::kInt8,
                           .block_size = 32,
                           .error_feedback = true};
  Run plain = make({});
  const std::vector<double> full_precision = steps(plain, 0, 6);
  Run straight = make(int8);
  std::vector<double> losses = steps(straight, 0, 3);
  const std::string checkpoint = checkpoint_dir_for_step(dir, 3);
  save_sharded_checkpoint(checkpoint, *straight.model, straight.opt.get());
  const std::vector<double> after = steps(straight, 3, 3);
  losses.insert(losses.end(), after.begin(), after.end());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NE(losses[i], full_precision[i]) << "step " << i << ": nothing was quantized";
    EXPECT_NEAR(losses[i], full_precision[i], 0.03 * full_precision[i]) << "step " << i;
  }
  Run resumed = make(int8);
  load_sharded_checkpoint(checkpoint, *resumed.model, resumed.opt.get());
  EXPECT_EQ(steps(resumed, 3, 3), after);
  testing::remove_after_all_ranks(dir);
}

}  // namespace
}  // namespace hp
