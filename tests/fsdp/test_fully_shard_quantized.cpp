// fully_shard with CommPolicy's codecs (quantized all-gather and reduce-scatter) against
// a reference that applies the same quantization in one process: the unsharded weights
// are every rank's shard quantized and dequantized, the sharded gradients the quantized
// per-rank gradients summed in rank order; training stays close to full precision and
// reruns bit for bit; error feedback's residuals resume from a checkpoint.
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/comm_codec.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/sharded_parameter.h"
#include "hyperparallel/trace.h"
#include "models/mlp.h"
#include "shared_dir.h"

namespace hp {
namespace {

using models::Mlp;
using testing::error_of;

constexpr int64_t kBlock = 8;  // small, so that shards hold several blocks and a short one

// A parameter laid out as fully_shard shards it on dim 0: [shards, padded_numel], each row
// a rank's chunk of ceil(rows / shards) rows, zero padded.
at::Tensor rank_major(const at::Tensor& full, int64_t shards) {
  const int64_t chunk = (full.size(0) + shards - 1) / shards;
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] = chunk * shards;
  at::Tensor padded = torch::zeros(shape, full.options());
  padded.narrow(0, 0, full.size(0)).copy_(full);
  return padded.view({shards, -1});
}

at::Tensor from_rank_major(const at::Tensor& rows, const at::Tensor& like) {
  std::vector<int64_t> shape = like.sizes().vec();
  shape[0] = -1;
  return rows.reshape(shape).narrow(0, 0, like.size(0));
}

at::Tensor round_trip(const at::Tensor& rows, CommCodec codec) {
  return dequantize_blocks(quantize_blocks(rows, codec, kBlock), kBlock, at::kFloat);
}

struct QuantizedMlp {
  Mlp reference{nullptr};
  Sharded<Mlp> model{nullptr};
  testing::ShardedParts parts;

  // bf16: parameters gathered and used in bf16, gradients reduced in fp32. shard_dim1:
  // matrices sharded on dim 1. offload: shards on the host.
  explicit QuantizedMlp(const CommPolicy& policy, bool comm_fusion = false, bool bf16 = false,
                        bool shard_dim1 = false, bool offload = false,
                        std::optional<DeviceMesh> mesh = std::nullopt, int64_t bucket_bytes = 0) {
    torch::manual_seed(42);
    reference = Mlp(5, 8, 9, 3, 2);
    torch::manual_seed(42);
    model = Sharded<Mlp>(5, 8, 9, 3, 2);
    FullyShardOptions options;
    options.comm_policy = policy;
    options.comm_fusion = comm_fusion;
    options.comm_fusion_bucket_bytes = bucket_bytes;
    if (bf16) {
      options.mp_policy.param_dtype = at::kBFloat16;
      options.mp_policy.reduce_dtype = at::kFloat;
    }
    if (shard_dim1) {
      options.shard_placement_fn = [](const std::string&,
                                      const at::Tensor& param) -> std::optional<Placement> {
        return param.dim() == 2 ? Placement::shard(1) : Placement::shard(0);
      };
    }
    options.offload_policy.offload = offload;
    if (mesh) options.mesh = *mesh;
    parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  }
  FSDPModule root() const { return parts.back().second; }

  static std::pair<at::Tensor, at::Tensor> batch(int64_t seed) {
    torch::manual_seed(seed);
    return {torch::randn({8, 5}), torch::randn({8, 3})};
  }
};

HP_DIST_TEST(FullyShardQuantized, UnshardedWeightsAreEveryShardQuantized, 2, 3) {
  const int64_t ranks = testing::world()->size();
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    SCOPED_TRACE(to_string(codec));
    QuantizedMlp f({.all_gather_codec = codec, .block_size = kBlock});
    for (const auto& [prefix, module] : f.parts) FSDPModule(module).unshard();
    int checked = 0;
    for (const auto& item : f.reference->named_parameters()) {
      const at::Tensor expected = from_rank_major(
          round_trip(rank_major(item.value().detach(), ranks), codec), item.value());
      const at::Tensor unsharded = f.model->named_parameters()[item.key()];
      ASSERT_EQ(unsharded.sizes(), item.value().sizes()) << item.key();
      EXPECT_TRUE(torch::equal(unsharded, expected)) << item.key();
      if (item.value().dim() == 2) {  // (a bias may have one value per block: exact)
        EXPECT_FALSE(torch::equal(unsharded, item.value())) << item.key() << " was not quantized";
      }
      ++checked;
    }
    EXPECT_EQ(checked, 2 + 2 * 4 + 2);
    for (const auto& [prefix, module] : f.parts) FSDPModule(module).reshard();
    // The shards themselves, which the optimizer steps, stay full precision.
    for (const auto& [prefix, module] : f.parts) {
      for (const auto& info : module.sharded_params()) {
        EXPECT_TRUE(torch::equal(module.full_tensor(info.name),
                                 f.reference->named_parameters()[prefix + info.name]))
            << prefix + info.name;
      }
    }
  }
}

HP_DIST_TEST(FullyShardQuantized, GradientsAreTheQuantizedPerRankGradientsSummed, 2, 3) {
  const int64_t ranks = testing::world()->size();
  const int64_t rank = testing::world()->rank();
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    SCOPED_TRACE(to_string(codec));
    QuantizedMlp f({.reduce_scatter_codec = codec, .block_size = kBlock});
    const auto [x, y] = QuantizedMlp::batch(7);
    torch::mse_loss(f.model(testing::local_batch(x, rank, ranks)),
                    testing::local_batch(y, rank, ranks))
        .backward();
    // Every rank's gradient, computed here on the reference, as each rank's reduce-scatter
    // input: quantized per destination row, dequantized, summed in rank order, averaged.
    std::map<std::string, std::vector<at::Tensor>> per_rank;
    for (int64_t r = 0; r < ranks; ++r) {
      f.reference->zero_grad();
      torch::mse_loss(f.reference(testing::local_batch(x, r, ranks)),
                      testing::local_batch(y, r, ranks))
          .backward();
      for (const auto& item : f.reference->named_parameters()) {
        per_rank[item.key()].push_back(round_trip(rank_major(item.value().grad(), ranks), codec));
      }
    }
    const auto grads = testing::full_grads(f.parts);
    for (const auto& [name, parts] : per_rank) {
      const at::Tensor expected =
          from_rank_major(at::sum(torch::stack(parts), {0}) / ranks, grads.at(name));
      EXPECT_LE(testing::max_abs_diff(grads.at(name), expected),
                1e-7 * expected.abs().max().item<double>())
          << name;
    }
  }
}

// 30 AdamW steps with int8 weights and gradients, per parameter, fused, with bf16
// parameters, matrices sharded on dim 1, shards offloaded and with error feedback: close to the
// full-precision reference, not equal to it, and the same bit for bit when run again.
// Steps [first, first + count) of AdamW on this rank's part of batch(step); this rank's
// losses.
std::vector<double> train_steps(QuantizedMlp& f, torch::optim::Optimizer& opt, int first,
                                int count) {
  const int64_t ranks = testing::world()->size();
  const int64_t rank = testing::world()->rank();
  std::vector<double> losses;
  for (int step = first; step < first + count; ++step) {
    const auto [x, y] = QuantizedMlp::batch(step);
    opt.zero_grad();
    const at::Tensor loss = torch::mse_loss(f.model(testing::local_batch(x, rank, ranks)),
                                            testing::local_batch(y, rank, ranks));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

HP_DIST_TEST(FullyShardQuantized, TrainsCloseToFullPrecisionAndRerunsBitwise, 2) {
  const int64_t ranks = testing::world()->size();
  const int64_t rank = testing::world()->rank();
  const CommPolicy int8 = {.all_gather_codec = CommCodec::kInt8,
                           .reduce_scatter_codec = CommCodec::kInt8,
                           .block_size = kBlock};
  struct Case {
    const char* name;
    bool comm_fusion = false, bf16 = false, shard_dim1 = false, offload = false,
         error_feedback = false;
    int64_t bucket_bytes = 0;
  };
  const auto train = [&](const Case& c, std::vector<double>* reference_losses) {
    CommPolicy policy = int8;
    policy.error_feedback = c.error_feedback;
    QuantizedMlp f(policy, c.comm_fusion, c.bf16, c.shard_dim1, c.offload, std::nullopt,
                   c.bucket_bytes);
    torch::optim::AdamW opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_opt(f.reference->parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      const auto [x, y] = QuantizedMlp::batch(step % 4);  // a few batches, seen again
      opt.zero_grad();
      ref_opt.zero_grad();
      const at::Tensor loss =
          torch::mse_loss(f.model(testing::local_batch(x, rank, ranks)).to(at::kFloat),
                          testing::local_batch(y, rank, ranks));
      loss.backward();
      opt.step();
      at::Tensor global = loss.detach().clone();
      all_reduce(global, ReduceOp::kAvg, *testing::world()->world_group()).wait();
      losses.push_back(global.item<double>());
      const at::Tensor ref_loss = torch::mse_loss(f.reference(x), y);
      ref_loss.backward();
      ref_opt.step();
      if (reference_losses) reference_losses->push_back(ref_loss.item<double>());
    }
    return losses;
  };
  for (const Case& c :
       {Case{"per parameter"}, Case{"comm_fusion", true}, Case{"bf16 parameters", false, true},
        Case{"Shard(1)", false, false, true}, Case{"offload", false, false, false, true},
        Case{"error feedback", false, false, false, false, true},
        Case{"error feedback, comm_fusion", true, false, false, false, true},
        Case{"error feedback, comm_fusion in buckets", true, false, false, false, true, 64}}) {
    SCOPED_TRACE(c.name);
    std::vector<double> reference;
    const std::vector<double> losses = train(c, &reference);
    EXPECT_EQ(losses, train(c, nullptr)) << "a rerun differs";
    EXPECT_NE(losses, reference) << "nothing was quantized";
    EXPECT_LT(reference.back(), 0.7 * reference.front()) << "the reference did not learn";
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(losses[i], reference[i], 0.03 * reference[i]) << "step " << i;
    }
  }
}

// comm_fusion in buckets moves the same values in more collectives: in full precision
// training is bitwise that of one collective per module, and of one per parameter.
HP_DIST_TEST(FullyShardQuantized, CommFusionBucketsChangeNoBitInFullPrecision, 2, 3) {
  const auto train = [&](bool comm_fusion, int64_t bucket_bytes) {
    QuantizedMlp f({}, comm_fusion, false, false, false, std::nullopt, bucket_bytes);
    torch::optim::AdamW opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
    const std::vector<double> losses = train_steps(f, opt, 0, 4);
    return std::make_pair(losses, testing::full_params(f.parts));
  };
  const auto [losses, params] = train(true, 0);
  for (const auto& [fusion, bucket_bytes] :
       {std::pair{true, int64_t{64}}, std::pair{true, int64_t{1}}, std::pair{false, int64_t{0}}}) {
    SCOPED_TRACE("comm_fusion " + std::to_string(fusion) + ", buckets of " +
                 std::to_string(bucket_bytes) + " bytes");
    const auto [other_losses, other_params] = train(fusion, bucket_bytes);
    EXPECT_EQ(other_losses, losses);
    for (const auto& [name, value] : params) {
      EXPECT_TRUE(torch::equal(other_params.at(name), value)) << name;
    }
  }
}

// Collects c10 warnings (TORCH_WARN) while alive.
struct CollectedWarnings : c10::WarningHandler {
  std::vector<std::string> messages;
  c10::WarningUtils::WarningHandlerGuard guard{this};
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
};

// A sharded checkpoint keeps each rank's error-feedback residuals: training resumed from it
// continues bit for bit as the uninterrupted run, per parameter and fused, on FSDP and
// HSDP; resumed with zero residuals it does not. Loaded on another mesh they start from
// zero, with a warning that says so.
HP_DIST_TEST(FullyShardQuantized, ErrorFeedbackResumesFromACheckpointBitwise, 2, 4) {
  auto world = testing::world();
  const int64_t ranks = world->size();
  const std::string dir = testing::shared_dir("hp_error_feedback_resume");
  const CommPolicy policy = {.all_gather_codec = CommCodec::kInt8,
                             .reduce_scatter_codec = CommCodec::kInt8,
                             .block_size = kBlock,
                             .error_feedback = true};
  const std::optional<DeviceMesh> saved_mesh =
      ranks == 4 ? std::optional(DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}}))
                 : std::nullopt;
  for (const bool comm_fusion : {false, true}) {
    SCOPED_TRACE(comm_fusion ? "comm_fusion" : "per parameter");
    const std::string checkpoint = checkpoint_dir_for_step(dir, comm_fusion ? 2 : 1);
    QuantizedMlp straight(policy, comm_fusion, false, false, false, saved_mesh);
    torch::optim::AdamW opt(straight.model->parameters(), torch::optim::AdamWOptions(1e-2));
    train_steps(straight, opt, 0, 3);
    save_sharded_checkpoint(checkpoint, *straight.model, &opt);
    const std::vector<double> expected = train_steps(straight, opt, 3, 3);

    // same_mesh: the residuals load; keep: they stay (else they are reset to zeros).
    const auto resumed = [&](const std::optional<DeviceMesh>& mesh, bool same_mesh, bool keep) {
      QuantizedMlp f(policy, comm_fusion, false, false, false, mesh);
      torch::optim::AdamW resumed_opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
      load_sharded_checkpoint(checkpoint, *f.model, &resumed_opt);
      for (const auto& param : f.model->parameters()) {
        const auto sharded = sharded_parameter_of(param);
        EXPECT_EQ(sharded->error_feedback_residual().defined(), same_mesh);
        if (!keep) sharded->set_error_feedback_residual(at::Tensor());
      }
      return train_steps(f, resumed_opt, 3, 3);
    };
    EXPECT_EQ(resumed(saved_mesh, true, true), expected);
    EXPECT_NE(resumed(saved_mesh, true, false), expected) << "the residuals made no difference";
    if (ranks == 4) {
      CollectedWarnings warnings;
      const std::vector<double> elsewhere = resumed(std::nullopt, false, true);  // 1x4
      ASSERT_FALSE(warnings.messages.empty());
      EXPECT_NE(warnings.messages.front().find("were saved on another mesh, so"), std::string::npos)
          << warnings.messages.front();
      for (size_t i = 0; i < elsewhere.size(); ++i) {
        EXPECT_NEAR(elsewhere[i], expected[i], 0.03 * expected[i]) << "step " << i;
      }
    }
  }
  testing::remove_after_all_ranks(dir);
}

// A step whose gradients hold inf/NaN (skipped, as a trainer does) leaves no NaN in the
// error-feedback residuals: the blocks that held them are dropped and counted, training
// goes on finite; reset_error_feedback then continues exactly as a run whose residuals
// were reset at the same step without ever seeing the non-finite one.
HP_DIST_TEST(FullyShardQuantized, ErrorFeedbackRecoversFromANonFiniteStep, 2) {
  const int64_t ranks = testing::world()->size();
  const int64_t rank = testing::world()->rank();
  const CommPolicy policy = {.all_gather_codec = CommCodec::kInt8,
                             .reduce_scatter_codec = CommCodec::kInt8,
                             .block_size = kBlock,
                             .error_feedback = true};
  for (const bool comm_fusion : {false, true}) {
    SCOPED_TRACE(comm_fusion ? "comm_fusion" : "per parameter");
    // poisoned: a backward with an inf in rank 0's batch before step 2, its gradients
    // dropped; reset: the residuals reset before step 2.
    const auto train = [&](bool poisoned, bool reset) {
      QuantizedMlp f(policy, comm_fusion);
      torch::optim::AdamW opt(f.model->parameters(), torch::optim::AdamWOptions(1e-2));
      std::vector<double> losses = train_steps(f, opt, 0, 2);
      EXPECT_EQ(f.root().error_feedback_blocks_dropped(), 0);
      if (poisoned) {
        auto [x, y] = QuantizedMlp::batch(100);
        if (rank == 0) x[0][0] = std::numeric_limits<float>::infinity();
        opt.zero_grad();
        torch::mse_loss(f.model(testing::local_batch(x, rank, ranks)),
                        testing::local_batch(y, rank, ranks))
            .backward();
        opt.zero_grad();  // the step is skipped
        // Only rank 0's gradients held them (the others' blocks of its rows come back NaN).
        if (rank == 0) {
          EXPECT_GT(f.root().error_feedback_blocks_dropped(), 0);
        } else {
          EXPECT_EQ(f.root().error_feedback_blocks_dropped(), 0);
        }
        for (const auto& param : f.model->parameters()) {
          const at::Tensor residual = sharded_parameter_of(param)->error_feedback_residual();
          EXPECT_TRUE(residual.isfinite().all().item<bool>());
        }
      }
      if (reset) {
        f.root().reset_error_feedback();
        EXPECT_EQ(f.root().error_feedback_blocks_dropped(), 0);
      }
      const std::vector<double> later = train_steps(f, opt, 2, 3);
      losses.insert(losses.end(), later.begin(), later.end());
      return losses;
    };
    for (const double loss : train(true, false)) EXPECT_TRUE(std::isfinite(loss));
    EXPECT_EQ(train(true, true), train(false, true));
  }
}

// The trace's collectives carry the bytes each sent: together what hp::wire_bytes counted,
// and with int8 about a quarter of fp32's.
HP_DIST_TEST(FullyShardQuantized, TracedCollectivesCarryTheBytesTheySent, 2) {
  const int64_t ranks = testing::world()->size();
  const int64_t rank = testing::world()->rank();
  const auto traced_bytes = [&](const CommPolicy& policy) {
    QuantizedMlp f(policy);
    const auto [x, y] = QuantizedMlp::batch(3);
    reset_wire_bytes();
    trace::start();
    torch::mse_loss(f.model(testing::local_batch(x, rank, ranks)),
                    testing::local_batch(y, rank, ranks))
        .backward();
    const std::vector<trace::Event> events = trace::stop();
    int64_t sum = 0;
    for (const trace::Event& e : events) {
      if (e.kind != trace::Kind::kIssue) continue;
      EXPECT_GT(e.bytes, 0) << trace::describe(e);
      sum += e.bytes;
    }
    EXPECT_EQ(sum, wire_bytes().total());
    return sum;
  };
  const int64_t full = traced_bytes({});
  const int64_t int8 = traced_bytes({.all_gather_codec = CommCodec::kInt8,
                                     .reduce_scatter_codec = CommCodec::kInt8,
                                     .block_size = kBlock});
  // Blocks of 8 values: 1 + 4/8 bytes per value against 4, plus padding to whole rows.
  EXPECT_LT(static_cast<double>(int8) / full, 0.45);
  EXPECT_GT(static_cast<double>(int8) / full, 0.3);
}

HP_DIST_TEST(FullyShardQuantized, ABadPolicyIsNamed, 1) {
  Sharded<Mlp> model(5, 8, 9, 3, 1);
  FullyShardOptions options;
  options.comm_policy.block_size = 0;
  EXPECT_NE(error_of([&] { fully_shard(model, options); }).find("comm_policy.block_size"),
            std::string::npos);
  options.comm_policy = {};
  options.comm_fusion_bucket_bytes = 1024;
  EXPECT_NE(error_of([&] {
              fully_shard(model, options);
            }).find("comm_fusion_bucket_bytes sizes the collectives of comm_fusion, which is off"),
            std::string::npos);
  options.comm_fusion = true;
  options.comm_fusion_bucket_bytes = -1;
  EXPECT_NE(
      error_of([&] { fully_shard(model, options); }).find("comm_fusion_bucket_bytes must be >= 0"),
      std::string::npos);
  options.comm_fusion_bucket_bytes = 0;
  options.comm_policy = {.error_feedback = true};
  EXPECT_NE(error_of([&] {
              fully_shard(model, options);
            }).find("comm_policy.error_feedback keeps the quantized reduce-scatter's residual"),
            std::string::npos);
}

}  // namespace
}  // namespace hp
