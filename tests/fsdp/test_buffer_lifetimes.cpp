// When buffers come to life and when they are freed:
//  - SizeOneShardGroup: with a shard group of size 1 an async unshard (prefetch) records a
//    pending unshard and materialises nothing until wait(); A/A runs are bitwise equal.
//  - ReduceScatterInputs: the library frees only reduce-scatter inputs it allocated; when
//    the input aliases the caller's gradient it is left alone.
#include <torch/torch.h>

#include "comm_handle_internals.h"
#include "distributed_test.h"
#include "fsdp_internals.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "models/mlp.h"
#include "src/fsdp/fsdp_param_group.h"

namespace hp {
namespace {

using models::Mlp;
using models::MlpBlock;

DeviceMesh replicate_only_mesh() {
  return DeviceMesh(testing::world(),
                    {{"dp_replicate", testing::world()->size()}, {"dp_shard", 1}});
}

HP_DIST_TEST(SizeOneShardGroup, SizeOneAsyncUnshardDefersMaterialisation, 2) {
  torch::manual_seed(1);
  Sharded<MlpBlock> block(4, 6);
  FullyShardOptions options;
  options.mesh = replicate_only_mesh();
  // bf16 unsharded parameters make "materialised" observable even with one shard rank.
  options.mp_policy.param_dtype = at::kBFloat16;
  FSDPModule fsdp = fully_shard(block, options);
  at::Tensor& weight = block->fc1->weight;
  const at::Tensor original = weight.detach().clone();

  CommHandle handle = fsdp.unshard(/*async_op=*/true);
  EXPECT_TRUE(handle.pending()) << "the unshard is recorded as pending";
  EXPECT_FALSE(testing::has_work(handle)) << "a shard group of one rank needs no collective";
  EXPECT_FALSE(fsdp.is_unsharded());
  EXPECT_EQ(weight.scalar_type(), at::kFloat) << "nothing materialised before wait()";

  {  // The shard changes after the prefetch was issued (an optimizer step, say).
    torch::NoGradGuard no_grad;
    weight.add_(1.0);
  }
  handle.wait();
  EXPECT_TRUE(fsdp.is_unsharded());
  EXPECT_EQ(weight.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::equal(weight.detach(), (original + 1.0).to(at::kBFloat16)))
      << "wait() materialises from the latest shard";
  const void* materialised = weight.data_ptr();
  handle.wait();
  EXPECT_EQ(weight.data_ptr(), materialised) << "a second wait() does nothing";

  // A pending unshard with no backend handle is completed by a blocking unshard too.
  fsdp.reshard();
  CommHandle second = fsdp.unshard(/*async_op=*/true);
  fsdp.unshard(/*async_op=*/false);
  EXPECT_TRUE(fsdp.is_unsharded());
  EXPECT_FALSE(second.pending()) << "the blocking unshard consumed the pending one";

  // Resharding while pending drops the pending unshard without materialising.
  fsdp.reshard();
  CommHandle dropped = fsdp.unshard(/*async_op=*/true);
  fsdp.reshard();
  dropped.wait();
  EXPECT_FALSE(fsdp.is_unsharded());
  EXPECT_EQ(weight.scalar_type(), at::kFloat);
}

// Loss and grad norm of `steps` AdamW steps on a 4-block model over a (replicate, 1)
// mesh with forward and backward prefetch across blocks.
std::vector<std::pair<float, float>> train_with_size_one_prefetch(int steps) {
  torch::manual_seed(5);
  Sharded<Mlp> model(5, 8, 12, 3, 4);
  FullyShardOptions options;
  options.mesh = replicate_only_mesh();
  std::vector<FSDPModule> blocks;
  for (auto& block : model->blocks) blocks.push_back(fully_shard(block, options));
  FSDPModule root = fully_shard(model, options);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i + 1 < blocks.size()) blocks[i].set_modules_to_forward_prefetch({blocks[i + 1]});
    if (i > 0) blocks[i].set_modules_to_backward_prefetch({blocks[i - 1]});  // layer i -> i-1
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto world = testing::world();
  std::vector<std::pair<float, float>> trace;
  torch::manual_seed(100);
  const at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                                      testing::local_batch(y, world->rank(), world->size()));
    loss.backward();
    double squares = 0;
    for (const auto& p : model->parameters()) squares += p.grad().pow(2).sum().item<double>();
    trace.emplace_back(loss.item<float>(), static_cast<float>(std::sqrt(squares)));
    opt.step();
  }
  return trace;
}

HP_DIST_TEST(SizeOneShardGroup, AARunsWithSizeOneBackwardPrefetchAreBitwiseEqual, 2) {
  auto first = train_with_size_one_prefetch(50);
  auto second = train_with_size_one_prefetch(50);
  ASSERT_EQ(first.size(), second.size());
  int different = 0;
  for (size_t step = 0; step < first.size(); ++step) {
    // Bitwise: compare the float bit patterns, not values within a tolerance.
    if (std::memcmp(&first[step], &second[step], sizeof(first[step])) != 0) ++different;
  }
  EXPECT_EQ(different, 0) << "steps whose loss or grad norm differ between two runs";
  EXPECT_LT(first.back().first, first.front().first) << "the model trains";
}

// End to end, against plain LibTorch on the global batch: unshards issued before the
// optimizer step (a prefetch of the next forward) are used by that forward, which must see
// the values the step wrote: a size-1 unshard materialises at its wait, not at its issue.
HP_DIST_TEST(SizeOneShardGroup, UnshardsIssuedBeforeTheStepUseTheUpdatedShards, 2) {
  torch::manual_seed(5);
  Mlp reference(5, 8, 12, 3, 2);
  torch::manual_seed(5);
  Sharded<Mlp> model(5, 8, 12, 3, 2);
  FullyShardOptions options;
  options.mesh = replicate_only_mesh();
  std::vector<FSDPModule> modules;
  for (auto& block : model->blocks) modules.push_back(fully_shard(block, options));
  modules.push_back(fully_shard(model, options));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(100);
  const at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
  std::vector<CommHandle> prefetches;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ref_opt.zero_grad();
    opt.zero_grad();
    const testing::StepLosses losses =
        testing::backward_on_global_batch(reference, model, x, y, testing::mse_loss);
    EXPECT_NEAR(testing::mean_over_ranks(losses.local).item<double>(),
                losses.reference.item<double>(), 1e-5)
        << "the forward used the parameters of the step before";
    prefetches.clear();
    for (FSDPModule& module : modules) prefetches.push_back(module.unshard(/*async_op=*/true));
    ref_opt.step();
    opt.step();
  }
}

struct ReduceCase {
  std::vector<int64_t> shape;
  c10::ScalarType reduce_dtype;
  bool expect_owned;  // whether the reduce-scatter input is the library's own buffer
};

HP_DIST_TEST(ReduceScatterInputs, ReduceFreesOnlyBuffersItAllocated, 2) {
  auto world = testing::world();
  const std::vector<ReduceCase> cases = {
      {{8, 3}, at::kFloat, false},    // aligned, same dtype: a view of the caller's grad
      {{7, 3}, at::kFloat, true},     // dim 0 padded: the library's own copy
      {{8, 3}, at::kBFloat16, true},  // cast: the library's own copy
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c10::str(c.shape, " reduce in ", c.reduce_dtype));
    at::Tensor variable = torch::zeros(c.shape, torch::requires_grad());
    detail::ParamPolicy policy;
    policy.reduce_dtype = c.reduce_dtype;
    std::vector<std::unique_ptr<detail::FSDPParam>> params;
    params.push_back(std::make_unique<detail::FSDPParam>("w", variable, 0, world->size(),
                                                         world->rank(), policy));
    detail::FSDPMeshInfo mesh_info{
        world,
        {"dp_shard"},
        world->world_group(),
        world->world_group(),
        world->new_group("self" + c10::str(c.shape, c.reduce_dtype) + std::to_string(world->rank()),
                         {world->rank()}),
        world->world_group()};
    detail::FSDPParamGroup group(std::move(params), {}, mesh_info, detail::CommFusion{},
                                 CommPolicy{});
    group.unshard(/*async=*/false);

    // The caller's gradient: this rank's values, kept by the caller after backward.
    torch::manual_seed(world->rank());
    at::Tensor caller_grad = torch::randn(c.shape);
    const at::Tensor expected_caller_values = caller_grad.clone();
    variable.mutable_grad() = caller_grad;
    group.start_reduce({/*sync=*/true, /*all_reduce=*/true, /*divide_factor=*/2.0});
    group.reshard();
    group.finish_reduce();

    const detail::ReduceBufferStats& stats = group.reduce_buffer_stats();
    EXPECT_EQ(stats.freed_owned, c.expect_owned ? 1 : 0);
    EXPECT_EQ(stats.kept_aliased, c.expect_owned ? 0 : 1);
    ASSERT_EQ(caller_grad.storage().nbytes(), expected_caller_values.numel() * sizeof(float))
        << "the caller's gradient storage was freed";
    EXPECT_TRUE(torch::equal(caller_grad, expected_caller_values));

    // And the reduction itself is right: the mean of both ranks' gradients, this
    // rank's rows.
    torch::manual_seed(0);
    at::Tensor mean = torch::randn(c.shape);
    torch::manual_seed(1);
    mean = (mean + torch::randn(c.shape)) / 2;
    const int64_t chunk = (c.shape[0] + 1) / 2;
    const int64_t rows = std::min(chunk, c.shape[0] - world->rank() * chunk);
    at::Tensor mine = mean.narrow(0, world->rank() * chunk, rows);
    const double atol = c.reduce_dtype == at::kFloat ? 1e-6 : 2e-2;
    EXPECT_TRUE(torch::allclose(variable.grad(), mine, 0, atol)) << variable.grad() << mine;
  }
}

// End to end with fp32 parameters, reduce_dtype=fp32 and apply_grad_on_fp32_main_grad,
// comm_fusion off (reduce-scatters from views of the gradients): gradients stay right
// across steps.
HP_DIST_TEST(ReduceScatterInputs, SameDtypeReduceTrainsCorrectly, 2) {
  torch::manual_seed(42);
  Mlp reference(5, 8, 9, 3, 2);
  torch::manual_seed(42);
  Sharded<Mlp> model(5, 8, 9, 3, 2);
  FullyShardOptions options;
  options.mp_policy.reduce_dtype = at::kFloat;
  options.mp_policy.apply_grad_on_fp32_main_grad = true;
  testing::ShardedParts parts =
      testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  auto world = testing::world();
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(step);
    at::Tensor x = torch::randn({8, 5}), y = torch::randn({8, 3});
    for (auto& [prefix, module] : parts) module.zero_grad();
    reference->zero_grad();
    torch::mse_loss(reference(x), y).backward();
    torch::mse_loss(model(testing::local_batch(x, world->rank(), 2)),
                    testing::local_batch(y, world->rank(), 2))
        .backward();
    testing::expect_all_close(testing::full_grads(parts), testing::reference_grads(*reference),
                              1e-5, "grad");
  }
  int64_t aliased = 0;
  for (auto& [prefix, module] : parts) aliased += testing::reduce_buffer_stats(module).kept_aliased;
  EXPECT_GT(aliased, 0)
      << "the aligned same-dtype path (reduce-scatter from a view of the gradient) was exercised";
}

}  // namespace
}  // namespace hp
