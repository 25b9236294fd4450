// Bad input to fully_shard gets an error that names the problem and the fix.
#include <torch/torch.h>

#include "distributed_test.h"
#include "error_of.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;

using testing::error_of;

#define EXPECT_ERROR(call, text) \
  EXPECT_NE(error_of([&] { call; }).find(text), std::string::npos) << error_of([&] { call; })

HP_DIST_TEST(FullyShardErrors, BadInputIsExplained, 2) {
  auto world = testing::world();
  Sharded<Mlp> model(5, 8, 9, 3, 2);

  EXPECT_ERROR(model.fsdp(), "was not fully_shard-ed");

  FullyShardOptions options;
  options.ignored_params = {torch::zeros({3})};
  EXPECT_ERROR(fully_shard(model->blocks[0], options), "ignored_params: a tensor of shape [3]");
  options = {};
  options.replicate_params = {model->head->weight};  // belongs to the root, not block 0
  EXPECT_ERROR(fully_shard(model->blocks[0], options), "replicate_params");

  options = {};
  options.shard_placement_fn = [](const std::string&, const at::Tensor&) {
    return Placement::shard(2);
  };
  EXPECT_ERROR(fully_shard(model->blocks[0], options), "the shard dim must be in [0, 2)");

  options = {};
  options.reshard_after_forward = int64_t{3};
  EXPECT_ERROR(fully_shard(model->blocks[0], options), "must divide the shard group size 2");

  // A mesh must match the process group world it is built over.
  EXPECT_ERROR(DeviceMesh(world, {{"dp_shard", 3}}), "has 3 ranks but the world has 2");

  options = {};
  options.mesh = DeviceMesh(world, {{"a", 1}, {"b", 1}, {"c", 2}});
  EXPECT_ERROR(fully_shard(model->blocks[0], options), "1-D mesh (FSDP) or a 2-D mesh");

  FSDPModule block = fully_shard(model->blocks[0]);
  EXPECT_ERROR(fully_shard(model->blocks[0]), "already applied");
  EXPECT_ERROR(block.set_reduce_op_type(ReduceOp::kMax), "ReduceOp::kSum or ReduceOp::kAvg");
  EXPECT_ERROR(block.set_gradient_divide_factor(0), "must be positive");
  EXPECT_ERROR(block.full_tensor("fc9.weight"), "no parameter 'fc9.weight'");

  // set_is_last_backward is about the root: on a block it is an error, found at the
  // first forward when called before it, and at once after it.
  block.set_is_last_backward(false);
  fully_shard(model->blocks[1]);
  fully_shard(model);
  EXPECT_ERROR(model(torch::randn({2, 5})), "not to be the root");
  Sharded<Mlp> fresh(5, 8, 9, 3, 1);
  FSDPModule fresh_block = fully_shard(fresh->blocks[0]);
  fully_shard(fresh);
  fresh(torch::randn({2, 5}));
  EXPECT_ERROR(fresh_block.set_is_last_backward(false), "applies to the root");

  // Bottom-up only: a block of an already sharded root is managed by the root.
  Sharded<Mlp> top_down(5, 8, 9, 3, 1);
  fully_shard(top_down);
  EXPECT_ERROR(fully_shard(top_down->blocks[0]), "apply fully_shard to submodules first");

  // comm_fusion packs one dtype.
  Sharded<Mlp> mixed(5, 8, 9, 3, 1);
  mixed->input->to(torch::kBFloat16);
  options = {};
  options.comm_fusion = true;
  EXPECT_ERROR(fully_shard(mixed, options), "different dtypes");

  // Moving or casting after fully_shard would be undone by the next unshard: refused.
  Sharded<Mlp> cast(5, 8, 9, 3, 1);
  fully_shard(cast->blocks[0]);
  fully_shard(cast);
  cast->to(torch::kFloat);  // no change: the shards stay
  {
    torch::NoGradGuard evaluation;
    cast(torch::randn({2, 5}));
  }
  cast->to(torch::kDouble);
  EXPECT_ERROR(cast(torch::randn({2, 5}, torch::kDouble)), "no longer holds its local shard");
}

}  // namespace
}  // namespace hp
