// Exception safety: a forward or backward that throws midway (here: real out-of-memory
// errors of the all-gather and of its completion, and a user hook that throws) leaves
// every module usable, and the next step matches the single-process reference. And
// misuse: a fully_shard-ed module called around its Sharded<M> is reported by name.
//
// Out of memory is real: the ranks lower their address-space limit (RLIMIT_AS) so that
// the next unsharded parameter does not fit, then lift it again. Every rank fails at the
// same point, so the ranks' collectives stay paired, as when a whole job retries a batch
// after running out of memory. The limits leave no allocation to Gloo's own threads
// (whose timing varies) near the edge: what fails is the first large allocation of the
// rank's main thread.
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "models/mlp.h"
#include "shared_dir.h"
#include "stopped_rank.h"

namespace hp {
namespace {

using models::Mlp;
using models::MlpBlock;
using testing::error_of;

constexpr double kTol = 1e-5;
// Blocks of 8 MiB weights (hidden 8192 x dim 256, fp32); the other parameters are small.
constexpr int64_t kIn = 16, kDim = 256, kHidden = 8192, kOut = 4, kBlocks = 2;
constexpr int64_t kMiB = 1 << 20;

// From now on, allocations of 256 KiB and more get their own mapping: glibc would
// otherwise serve large ones from heap memory kept after earlier frees, which an
// address-space limit does not reach. Called first thing in each test body.
void large_allocations_mapped() { mallopt(M_MMAP_THRESHOLD, 256 * 1024); }

// While alive, this process may map only `headroom` bytes more than it has mapped now.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(int64_t headroom) {
    malloc_trim(0);
    // The mechanism's precondition: no free heap memory could hold an 8 MiB weight.
    EXPECT_LT(mallinfo2().fordblks, static_cast<size_t>(8 * kMiB));
    getrlimit(RLIMIT_AS, &previous_);
    int64_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    rlimit limit = previous_;
    limit.rlim_cur = static_cast<rlim_t>(pages * sysconf(_SC_PAGESIZE) + headroom);
    EXPECT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
  }
  ~AddressSpaceLimit() { setrlimit(RLIMIT_AS, &previous_); }
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;

 private:
  rlimit previous_{};
};

int64_t numel_of(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

// A sharded Mlp next to its reference, trained with SGD on global batches.
struct Run {
  Mlp reference{nullptr};
  Sharded<Mlp> model{nullptr};
  testing::ShardedParts parts;  // blocks, then the root
  std::unique_ptr<torch::optim::SGD> ref_opt, opt;
  std::vector<int64_t> sharded_numel;  // per block, while sharded

  // root_options: the root's, if not `options`.
  explicit Run(const FullyShardOptions& options,
               const std::optional<FullyShardOptions>& root_options = std::nullopt) {
    auto built = testing::build_from_seed<Mlp>(42, kIn, kDim, kHidden, kOut, kBlocks);
    reference = built.reference;
    model = built.model;
    // The 8 MiB weights are frozen: gathered like any other parameter (what the limits
    // aim at), while the gradients (biases, input, head) keep fp32 norms small enough to
    // compare at 1e-5; the norm of millions of fp32 gradient entries is not that exact.
    for (Mlp* m : std::initializer_list<Mlp*>{&reference, &model}) {
      for (auto& block : (*m)->blocks) {
        block->fc1->weight.requires_grad_(false);
        block->fc2->weight.requires_grad_(false);
      }
    }
    parts = testing::shard_blocks_then_root(model->blocks, model, "blocks.", options,
                                            root_options.value_or(options));
    ref_opt =
        std::make_unique<torch::optim::SGD>(reference->parameters(), torch::optim::SGDOptions(0.1));
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    for (auto& block : model->blocks) sharded_numel.push_back(numel_of(*block.ptr()));
  }

  FSDPModule root() const { return parts.back().second; }

  std::pair<at::Tensor, at::Tensor> batch(int64_t step) const {
    torch::manual_seed(100 + step);
    return {torch::randn({8, kIn}), torch::randn({8, kOut})};
  }
  at::Tensor local(const at::Tensor& global) const {
    auto world = testing::world();
    return testing::local_batch(global, world->rank(), world->size());
  }

  // One step of both models on batch `step`: loss, grad norm, every gradient and every
  // parameter after the optimizer step must match.
  void step_matches_reference(int64_t step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ref_opt->zero_grad();
    opt->zero_grad();
    const auto [x, y] = batch(step);
    const testing::StepLosses losses =
        testing::backward_on_global_batch(reference, model, x, y, testing::mse_loss);
    EXPECT_NEAR(testing::mean_over_ranks(losses.local).item<double>(),
                losses.reference.item<double>(), kTol)
        << "loss";
    auto grads = testing::full_grads(parts);
    auto ref_grads = testing::reference_grads(*reference);
    EXPECT_NEAR(testing::norm_of(grads), testing::norm_of(ref_grads), kTol) << "grad norm";
    testing::expect_all_close(grads, ref_grads, kTol, "grad");
    ref_opt->step();
    opt->step();
    testing::expect_all_close(testing::full_params(parts), testing::reference_params(*reference),
                              kTol, "param after step");
  }

  // After a failure: every block holds its shard again, nothing stays gathered.
  void expect_all_sharded() {
    for (size_t i = 0; i < model->blocks.size(); ++i) {
      EXPECT_EQ(numel_of(*model->blocks[i].ptr()), sharded_numel[i]) << "block " << i;
      EXPECT_FALSE(parts[i].second.is_unsharded()) << "block " << i;
    }
  }
};

// Pre-forward throws (the all-gather's unsharded storage does not fit): in the root's
// pre-forward, which prefetches block 0, or with prefetching off in block 0's own. The
// failed forward leaves nothing gathered; the step then runs again and matches.
void pre_forward_out_of_memory(bool implicit_prefetch) {
  large_allocations_mapped();
  Run run({});
  run.root().set_implicit_prefetch(implicit_prefetch);
  run.step_matches_reference(0);
  const auto [x, y] = run.batch(1);
  std::string error;
  {
    // The first 8 MiB unsharded weight does not fit; the root's own (small) all-gathers
    // are in flight when it fails.
    AddressSpaceLimit limit(4 * kMiB);
    error = error_of([&] { run.model(run.local(x)); });
  }
  EXPECT_NE(error.find("DefaultCPUAllocator: can't allocate memory"), std::string::npos) << error;
  run.expect_all_sharded();
  run.step_matches_reference(1);
  run.step_matches_reference(2);
}

HP_DIST_TEST(FullyShardFailures, PreForwardOutOfMemoryInPrefetch, 2) {
  pre_forward_out_of_memory(/*implicit_prefetch=*/true);
}

HP_DIST_TEST(FullyShardFailures, PreForwardOutOfMemory, 2) {
  pre_forward_out_of_memory(/*implicit_prefetch=*/false);
}

// The unshard is issued, but its completion callback fails: with a shard group of one
// rank (HSDP replicate x 1) and param_dtype double, the callback casts each shard and
// copies it into the unsharded storage; the second weight's storage does not fit. The
// error reaches the forward, the module is not left pending, and the next step matches.
HP_DIST_TEST(FullyShardFailures, UnshardCompletionOutOfMemory, 2) {
  large_allocations_mapped();
  FullyShardOptions options;
  options.mesh = DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 1}});
  options.mp_policy.param_dtype = torch::kDouble;
  FullyShardOptions root_options = options;
  root_options.mp_policy.output_dtype = torch::kFloat;  // the loss compares with fp32 targets
  Run run(options, root_options);
  run.step_matches_reference(0);
  const auto [x, y] = run.batch(1);
  std::string error;
  {
    // 16 MiB per weight in double: the first weight's cast copy and storage (32 MiB) fit,
    // the second's storage on top of the first's (48 MiB) does not.
    AddressSpaceLimit limit(40 * kMiB);
    error = error_of([&] { run.model(run.local(x)); });
  }
  EXPECT_NE(error.find("DefaultCPUAllocator: can't allocate memory"), std::string::npos) << error;
  run.expect_all_sharded();
  run.step_matches_reference(1);
  run.step_matches_reference(2);
}

// The root's pre-backward hook (prefetching the last block) runs out of memory: the
// backward throws, no module stays unsharded or marked "in backward", and the next step
// matches.
HP_DIST_TEST(FullyShardFailures, PreBackwardOutOfMemory, 2) {
  large_allocations_mapped();
  Run run({});
  run.step_matches_reference(0);
  run.opt->zero_grad();
  const auto [x, y] = run.batch(1);
  at::Tensor loss = torch::mse_loss(run.model(run.local(x)), run.local(y));
  std::string error;
  {
    AddressSpaceLimit limit(4 * kMiB);
    error = error_of([&] { loss.backward(); });
  }
  EXPECT_NE(error.find("DefaultCPUAllocator: can't allocate memory"), std::string::npos) << error;
  run.expect_all_sharded();
  run.step_matches_reference(1);
  run.step_matches_reference(2);
}

// A hook of the user's throws at the very end of backward, after every module's
// post-backward issued its reduction: the engine drops fully_shard's end-of-backward
// callback. The next forward recovers, drops the unfinished reductions (the user zeroes
// gradients after a failed step; they must not land afterwards), and the step matches.
HP_DIST_TEST(FullyShardFailures, UserHookThrowsInBackward, 2) {
  Run run({});
  run.step_matches_reference(0);
  const auto [x, y] = run.batch(1);
  at::Tensor input = run.local(x).clone().requires_grad_(true);
  input.register_hook([](const at::Tensor&) { throw std::runtime_error("user hook failed"); });
  at::Tensor loss = torch::mse_loss(run.model(input), run.local(y));
  EXPECT_NE(error_of([&] { loss.backward(); }).find("user hook failed"), std::string::npos);
  run.step_matches_reference(1);
  run.step_matches_reference(2);
}

// --- misuse: calling around Sharded<M> ---------------------------------------------------

// Blocks called through a Sequential: the Sequential calls impl->forward, never
// Sharded::operator().
struct SequentialModelImpl : torch::nn::Module {
  SequentialModelImpl() {
    for (int i = 0; i < 2; ++i) blocks.emplace_back(MlpBlock(6, 10));
    layers = register_module("layers", torch::nn::Sequential(blocks[0], blocks[1]));
  }
  at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
  std::vector<Sharded<MlpBlock>> blocks;
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(SequentialModel);

// A block called through its holder's ->forward.
struct ArrowModelImpl : torch::nn::Module {
  ArrowModelImpl() : block(register_module("block", MlpBlock(6, 10))) {}
  at::Tensor forward(const at::Tensor& x) { return block->forward(x).sum(-1); }
  Sharded<MlpBlock> block;
};
TORCH_MODULE(ArrowModel);

// With a shard group of one rank (HSDP replicate x 1) the bypassed forward computes on
// the shards, which hold the whole parameters: without the check the backward would
// succeed with unreduced gradients and the replicas would drift apart silently.
HP_DIST_TEST(FullyShardFailures, BypassingShardedIsReported, 2) {
  FullyShardOptions options;
  options.mesh = DeviceMesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 1}});
  at::Tensor x = torch::randn({4, 6});

  Sharded<SequentialModel> sequential;
  for (auto& block : sequential->blocks) fully_shard(block, options);
  fully_shard(sequential, options);
  const std::string error = error_of([&] { sequential(x).sum().backward(); });
  EXPECT_NE(error.find("of the fully_shard-ed module 'layers.1' got a gradient while sharded"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("hp::Sharded<...> as module(x)"), std::string::npos) << error;

  Sharded<ArrowModel> arrow;
  fully_shard(arrow->block, options);
  fully_shard(arrow, options);
  EXPECT_NE(error_of([&] {
              arrow(x).sum().backward();
            }).find("of the fully_shard-ed module 'block' got a gradient while sharded"),
            std::string::npos);
}

// A rank that stops mid-step (SIGSTOP: a frozen process or machine) surfaces on the others
// within the timeout + 3 s, as one error naming the collective and the stopped rank: the
// collectives still in flight with it fail with the first instead of each waiting out the
// timeout and a report window of its own. The stopped rank is resumed afterwards and fails
// too.
void stopped_rank_surfaces_within_the_bound(bool comm_fusion) {
  constexpr auto kTimeout = std::chrono::seconds(2);
  auto world = World::from_env(WorldOptions{kTimeout});
  const int64_t stopped = world->size() - 1;
  torch::manual_seed(42);
  Sharded<Mlp> model(8, 16, 32, 4, 3);
  FullyShardOptions options;
  options.mesh = DeviceMesh(world, {{"shard", world->size()}});
  options.comm_fusion = comm_fusion;
  for (auto& block : model->blocks) fully_shard(block, options);
  fully_shard(model, options);
  const auto step = [&] { model(torch::randn({4, 8})).sum().backward(); };
  step();  // on every rank: the groups and the lazy initialization are done

  const std::string dir = testing::shared_dir("hp_stopped_rank");
  const std::string tag = std::to_string(world->size()) + (comm_fusion ? "_fused" : "");
  const std::string pid_file = dir + "/pid_" + tag;
  const auto done_file = [&](int64_t rank) {
    return dir + "/done_" + tag + "_" + std::to_string(rank);
  };
  if (world->rank() == stopped) {
    std::ofstream(pid_file + ".partial") << getpid();
    std::filesystem::rename(pid_file + ".partial", pid_file);
    raise(SIGSTOP);
    EXPECT_NE(error_of(step), "no error") << "the others gave up on this step";
    return;
  }
  pid_t pid = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  const auto is_stopped = [&] {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string pid_field, name, state;
    stat >> pid_field >> name >> state;  // the program name has no spaces here
    return state == "T";
  };
  while (!(std::ifstream(pid_file) >> pid) || !is_stopped()) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "rank " << stopped << " did not stop";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of(step);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The stopped rank is named among those that did not report; on a loaded machine a rank
  // that started the step late may be named with it.
  std::smatch late;
  ASSERT_TRUE(std::regex_search(
      error, late, std::regex("world ranks? ([0-9, ]+) did not report the same failure")))
      << error;
  EXPECT_TRUE(
      std::regex_search(late[1].str(), std::regex("(^|, )" + std::to_string(stopped) + "(,|$)")))
      << error;
  EXPECT_LT(seconds, 2.0 + 3.0) << error;
  std::ofstream(done_file(world->rank())) << "";
  if (world->rank() != 0) return;
  for (int64_t r = 0; r < stopped; ++r) {
    while (!std::filesystem::exists(done_file(r))) {
      ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "rank " << r << " did not finish";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  kill(pid, SIGCONT);
}

HP_DIST_TEST(FullyShardFailures, AStoppedRankSurfacesWithinTheTimeoutPlus3s, 2, 4) {
  stopped_rank_surfaces_within_the_bound(/*comm_fusion=*/false);
}

HP_DIST_TEST(FullyShardFailures, AStoppedRankSurfacesWithinTheTimeoutPlus3sFused, 2) {
  stopped_rank_surfaces_within_the_bound(/*comm_fusion=*/true);
}

// On a 2x2 mesh (HSDP: replicas {0, 2} and {1, 3}, shards {0, 1} and {2, 3}) with rank 2
// stopped, every other rank fails within the timeout + 3 s of the stop, its World and model
// destroyed too (as when the error leaves a program's main, which prints it then), naming
// rank 2 alone: rank 1 meets rank 2 only through rank 3 (its replica), which is blocked in
// a collective with rank 2 and fails there; naming rank 3, live, would send the user to
// the wrong rank.
HP_DIST_TEST(FullyShardFailures, AStoppedRankOfATwoByTwoMeshIsNamedByEveryOther, 4) {
  constexpr auto kTimeout = std::chrono::seconds(2);
  constexpr int64_t kStopped = 2;
  testing::StoppedRank stopped(testing::shared_dir("hp_stopped_mesh"), "2x2");
  int64_t rank = -1;
  std::chrono::steady_clock::time_point start;
  std::string error;
  {
    auto world = World::from_env(WorldOptions{kTimeout});
    rank = world->rank();
    torch::manual_seed(42);
    Sharded<Mlp> model(8, 16, 32, 4, 3);
    FullyShardOptions options;
    options.mesh = DeviceMesh(world, {{"replicate", 2}, {"shard", 2}});
    for (auto& block : model->blocks) fully_shard(block, options);
    fully_shard(model, options);
    const auto step = [&] { model(torch::randn({4, 8})).sum().backward(); };
    step();  // on every rank: the groups and the lazy initialization are done
    if (rank == kStopped) {
      stopped.stop_here();
      EXPECT_NE(error_of(step), "no error") << "the others gave up on this step";
      return;
    }
    ASSERT_TRUE(stopped.wait_until_stopped());
    start = std::chrono::steady_clock::now();
    error = error_of(step);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::smatch absent;
  ASSERT_TRUE(std::regex_search(
      error, absent, std::regex("world ranks? ([0-9, ]+) did not report the same failure")))
      << error;
  EXPECT_EQ(absent[1].str(), "2") << error;
  EXPECT_LT(seconds, 2.0 + 3.0) << error;
  std::printf("rank %lld failed after %.2f s: %s\n", static_cast<long long>(rank), seconds,
              error.c_str());
  stopped.done(rank, /*resumer=*/0, {1, 3});
}

}  // namespace
}  // namespace hp
