// ZeRO-3 memory, counted with the CPU allocator probe (live tensor bytes, not RSS):
// resharding after forward frees the blocks' unsharded parameters until backward
// gathers them again, an int reshard_after_forward keeps exactly the sub-group's part,
// nothing stays allocated after the step, and a backward that reaches freed storage
// fails instead of reading garbage.
#include <torch/torch.h>

#include <variant>

#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;
using ReshardAfterForward = std::variant<bool, int64_t>;

constexpr int64_t kIn = 8, kDim = 64, kHidden = 96, kOut = 8, kBlocks = 8, kBatch = 4;

struct Variant {
  bool comm_fusion = false;
  bool shard_dim1 = false;  // Shard(1) for the weights instead of Shard(0)
  std::optional<c10::ScalarType> param_dtype;
  std::string name() const {
    return std::string(comm_fusion ? "comm_fusion" : "per-parameter") +
           (shard_dim1 ? ", Shard(1)" : "") + (param_dtype ? ", bf16 params" : "");
  }
};

FullyShardOptions block_options(const Variant& v, ReshardAfterForward reshard) {
  FullyShardOptions options;
  options.reshard_after_forward = reshard;
  options.comm_fusion = v.comm_fusion;
  options.mp_policy.param_dtype = v.param_dtype;
  if (v.param_dtype) options.mp_policy.output_dtype = at::kFloat;  // the root computes in fp32
  if (v.shard_dim1) {
    options.shard_placement_fn = [](const std::string&, const at::Tensor& p) {
      return std::optional<Placement>(p.dim() == 2 ? Placement::shard(1) : Placement::shard(0));
    };
  }
  return options;
}

// Bytes of the unsharded storage fully_shard keeps for the parameters of `module`: the
// padded rank-major all-gather buffer for Shard(0), the parameter itself otherwise.
int64_t unsharded_bytes(const FSDPModule& module, int64_t element_size) {
  const int64_t world = testing::world()->size();
  int64_t bytes = 0;
  for (const auto& info : module.sharded_params()) {
    int64_t numel = 1;
    for (int64_t extent : info.global_shape) numel *= extent;
    if (info.placement.dim() == 0) {
      const int64_t rows = info.global_shape[0];
      numel = numel / rows * ((rows + world - 1) / world) * world;
    }
    bytes += numel * element_size;
  }
  return bytes;
}

// Bytes each block keeps after forward with reshard_after_forward = k: k consecutive
// shard ranks hold it, so this rank keeps world / k padded shards of every parameter.
int64_t post_forward_part_bytes(const FSDPModule& module, int64_t k) {
  return unsharded_bytes(module, sizeof(float)) / k;
}

struct Measured {
  int64_t at_boundary = 0;  // live bytes allocated by the forward, kept for backward
  int64_t after_step = 0;   // live bytes left after backward and zero_grad
  int64_t block_bytes = 0;  // unsharded bytes of one block
  int64_t root_bytes = 0;   // unsharded bytes of the root's own parameters
  int64_t part_bytes = 0;   // post-forward parts of all blocks (int reshard)
};

// Second training step's forward/backward boundary (the first one sets the implicit
// prefetch order) of an Mlp whose blocks are sharded with `reshard`.
Measured measure(const Variant& v, ReshardAfterForward reshard) {
  auto& probe = testing::CpuMemoryProbe::installed();
  torch::manual_seed(0);
  Sharded<Mlp> model(kIn, kDim, kHidden, kOut, kBlocks);
  auto parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.",
                                               block_options(v, reshard), {});
  const at::Tensor input = torch::randn({kBatch, kIn});
  Measured m;
  const int64_t element_size = v.param_dtype ? 2 : 4;
  m.block_bytes = unsharded_bytes(parts.front().second, element_size);
  m.root_bytes = unsharded_bytes(parts.back().second, 4);
  if (const int64_t* k = std::get_if<int64_t>(&reshard)) {
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      m.part_bytes += post_forward_part_bytes(parts[i].second, *k);
    }
  }
  FSDPModule root = parts.back().second;
  model(input).sum().backward();
  root.zero_grad();
  const int64_t before = probe.settled_live();
  at::Tensor loss = model(input).sum();
  m.at_boundary = probe.settled_live() - before;
  loss.backward();
  loss = at::Tensor();
  root.zero_grad();
  m.after_step = probe.settled_live() - before;
  return m;
}

// Live bytes the plain single-process model's forward keeps for backward.
int64_t reference_activation_bytes() {
  auto& probe = testing::CpuMemoryProbe::installed();
  torch::manual_seed(0);
  Mlp reference(kIn, kDim, kHidden, kOut, kBlocks);
  const at::Tensor input = torch::randn({kBatch, kIn});
  const int64_t before = probe.live();
  at::Tensor loss = reference(input).sum();
  return probe.live() - before;
}

void expect_reshard_after_forward_frees(const Variant& v) {
  SCOPED_TRACE(v.name());
  const Measured resharded = measure(v, true);
  const Measured kept = measure(v, false);
  // Reshard after forward drops every block but the (at most) two in flight.
  EXPECT_GE(kept.at_boundary - resharded.at_boundary, (kBlocks - 2) * resharded.block_bytes)
      << "reshard_after_forward=true freed less than (L-2)/L of the blocks";
  if (!v.param_dtype) {
    // Slack: the forward's own bookkeeping besides activations (a few small tensors).
    constexpr int64_t kSlack = 4096;
    EXPECT_LE(resharded.at_boundary, reference_activation_bytes() + resharded.root_bytes +
                                         2 * resharded.block_bytes + kSlack);
  }
  EXPECT_EQ(resharded.after_step, 0) << "bytes left allocated after the step";
  EXPECT_EQ(kept.after_step, 0) << "bytes left allocated after the step";
}

HP_DIST_TEST(FullyShardMemory, ReshardAfterForwardFreesUnshardedBlocks, 2, 4) {
  expect_reshard_after_forward_frees({});
  expect_reshard_after_forward_frees({.comm_fusion = true});
  expect_reshard_after_forward_frees({.shard_dim1 = true});
  expect_reshard_after_forward_frees({.param_dtype = at::kBFloat16});
}

HP_DIST_TEST(FullyShardMemory, IntReshardKeepsExactlyTheSubGroupPart, 4) {
  for (const Variant& v : {Variant{}, Variant{.comm_fusion = true}, Variant{.shard_dim1 = true}}) {
    SCOPED_TRACE(v.name());
    const Measured resharded = measure(v, true);
    const Measured to_pairs = measure(v, int64_t{2});
    EXPECT_EQ(to_pairs.at_boundary - resharded.at_boundary, to_pairs.part_bytes);
    EXPECT_EQ(to_pairs.after_step, 0) << "post-forward parts left allocated after the step";
  }
}

HP_DIST_TEST(FullyShardMemory, DroppingTheModelFreesItsMemory, 2) {
  auto& probe = testing::CpuMemoryProbe::installed();
  const at::Tensor input = torch::randn({kBatch, kIn});
  std::weak_ptr<torch::nn::Module> dropped;
  const int64_t before = probe.settled_live();
  {
    Sharded<Mlp> model(kIn, kDim, kHidden, kOut, kBlocks);
    testing::shard_blocks_then_root(model->blocks, model, "blocks.", {.comm_fusion = true}, {});
    torch::optim::AdamW optimizer(model->parameters());
    model(input).sum().backward();
    optimizer.step();
    dropped = model.ptr();
  }
  EXPECT_TRUE(dropped.expired()) << "something still holds the model";
  EXPECT_EQ(probe.settled_live(), before) << "bytes still allocated after the model was dropped";
}

HP_DIST_TEST(FullyShardMemory, BackwardThroughFreedStorageFails, 2) {
  torch::manual_seed(0);
  Sharded<torch::nn::Linear> layer(torch::nn::LinearOptions(6, 4));
  FSDPModule fsdp = fully_shard(layer);
  const at::Tensor input = torch::randn({3, 6}, torch::requires_grad());
  fsdp.unshard();
  // Outside the module's forward: no hook will gather the weight again for backward.
  at::Tensor out = torch::nn::functional::linear(input, layer->weight);
  fsdp.reshard();
  const std::string error = testing::error_of([&] { out.sum().backward(); });
  // LibTorch's own checks stop it: a view of the freed storage is out of its bounds, a
  // direct read finds no data.
  const bool refused = error.find("storage of size 0") != std::string::npos ||
                       error.find("not allocated") != std::string::npos;
  EXPECT_TRUE(refused) << error;
}

}  // namespace
}  // namespace hp
