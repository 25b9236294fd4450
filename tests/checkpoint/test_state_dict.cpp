// Full state dicts and checkpoint files of fully_shard-ed models: whole tensors named as
// in the unsharded model, independent of the mesh they were saved from.
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/state_dict.h"
#include "models/mlp.h"

namespace hp {
namespace {

using models::Mlp;
using testing::error_of;

// Uneven sizes: shards are padded on 2, 3 and 4 ranks. A buffer rides along.
Mlp plain_model(uint64_t seed) {
  torch::manual_seed(seed);
  Mlp model(5, 7, 9, 3, 3);
  model->register_buffer("scale", torch::linspace(0.5, 1.5, 4));
  return model;
}

Sharded<Mlp> sharded_model(uint64_t seed, const FullyShardOptions& options) {
  Sharded<Mlp> model(plain_model(seed));
  testing::shard_blocks_then_root(model->blocks, model, "blocks.", options);
  return model;
}

void expect_equal_dicts(const StateDict& actual, const StateDict& expected) {
  ASSERT_EQ(actual.keys(), expected.keys());
  for (const auto& item : expected) {
    EXPECT_TRUE(torch::equal(actual[item.key()], item.value())) << item.key();
  }
}

// One AdamW step on this rank's share of a fixed batch, so that parameters are no longer
// the initial ones.
void train_one_step(Sharded<Mlp>& model) {
  auto world = testing::world();
  torch::manual_seed(5);
  at::Tensor x = torch::randn({12, 5}), y = torch::randn({12, 3});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                  testing::local_batch(y, world->rank(), world->size()))
      .backward();
  opt.step();
}

HP_DIST_TEST(StateDict, FullStateDictIsTheUnshardedModel, 1, 2, 3, 4) {
  Mlp reference = plain_model(42);
  Sharded<Mlp> model = sharded_model(42, {});
  StateDict expected;
  for (const auto& item : reference->named_parameters()) expected.insert(item.key(), item.value());
  for (const auto& item : reference->named_buffers()) expected.insert(item.key(), item.value());
  expect_equal_dicts(get_full_state_dict(*model), expected);
}

HP_DIST_TEST(StateDict, LoadsAcrossMeshesAndIntoThePlainModel, 4) {
  auto world = testing::world();
  // Saved from 2x2 HSDP with one parameter replicated and fused collectives ...
  FullyShardOptions hsdp;
  hsdp.mesh = DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
  hsdp.comm_fusion = true;
  hsdp.shard_placement_fn = [](const std::string& name,
                               const at::Tensor&) -> std::optional<Placement> {
    if (name == "head.bias") return Placement::replicate();
    if (name == "input.weight") return Placement::shard(1);
    return std::nullopt;
  };
  Sharded<Mlp> saved = sharded_model(42, hsdp);
  train_one_step(saved);
  const StateDict state = get_full_state_dict(*saved);

  // ... loaded into 1-D FSDP over 4 ranks (other shard sizes) of another initialization,
  Sharded<Mlp> loaded = sharded_model(1, {});
  set_full_state_dict(*loaded, state);
  expect_equal_dicts(get_full_state_dict(*loaded), state);
  // ... and into the plain model on one process: all three compute the same.
  Mlp plain = plain_model(2);
  set_full_state_dict(*plain, state);
  torch::manual_seed(9);
  const at::Tensor x = torch::randn({4, 5});
  torch::NoGradGuard no_grad;
  const at::Tensor expected = plain(x);
  EXPECT_TRUE(torch::equal(loaded(x), expected));
  EXPECT_TRUE(torch::allclose(saved(x), expected, 0, 1e-6));  // another reduction layout
}

HP_DIST_TEST(StateDict, CheckpointFileRoundTrip, 2) {
  auto world = testing::world();
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("hp_state_dict_" + std::to_string(getppid()) + ".pt"))
                               .string();
  Sharded<Mlp> saved = sharded_model(42, {});
  train_one_step(saved);
  save_full_checkpoint(*saved, path);
  barrier(*world->world_group()).wait();  // rank 0 wrote it
  Sharded<Mlp> loaded = sharded_model(1, {});
  load_full_checkpoint(*loaded, path);
  expect_equal_dicts(get_full_state_dict(*loaded), get_full_state_dict(*saved));
  barrier(*world->world_group()).wait();
  if (world->rank() == 0) std::filesystem::remove(path);
}

HP_DIST_TEST(StateDict, BadStateDictsAreRejectedAndLeaveTheModelUnchanged, 2) {
  Sharded<Mlp> model = sharded_model(42, {});
  const StateDict good = get_full_state_dict(*model);

  StateDict missing = good;
  missing.erase("blocks.1.fc2.weight");
  EXPECT_NE(error_of([&] {
              set_full_state_dict(*model, missing);
            }).find("no entry for 'blocks.1.fc2.weight'"),
            std::string::npos);
  StateDict reshaped = good;
  reshaped["head.weight"] = torch::zeros({7, 3});
  EXPECT_NE(error_of([&] {
              set_full_state_dict(*model, reshaped);
            }).find("'head.weight' has shape [7, 3]"),
            std::string::npos);
  StateDict extra = good;
  extra.insert("head.gain", torch::ones({3}));
  EXPECT_NE(
      error_of([&] { set_full_state_dict(*model, extra); }).find("'head.gain' is not a parameter"),
      std::string::npos);
  EXPECT_EQ(error_of([&] { set_full_state_dict(*model, extra, /*strict=*/false); }), "no error");
  expect_equal_dicts(get_full_state_dict(*model), good);

  // Between a forward and its backward the parameters are unsharded.
  Sharded<Mlp> other = sharded_model(7, FullyShardOptions{.reshard_after_forward = false});
  at::Tensor loss = other(torch::randn({2, 5})).sum();
  EXPECT_NE(error_of([&] { get_full_state_dict(*other); }).find("is unsharded now"),
            std::string::npos);
  loss.backward();
}

// Global batch `step` of a fixed sequence.
std::pair<at::Tensor, at::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({12, 5}), torch::randn({12, 3})};
}

void step_on(Sharded<Mlp>& model, torch::optim::Optimizer& opt, int step) {
  auto world = testing::world();
  const auto [x, y] = batch(step);
  opt.zero_grad();
  torch::mse_loss(model(testing::local_batch(x, world->rank(), world->size())),
                  testing::local_batch(y, world->rank(), world->size()))
      .backward();
  opt.step();
}

// Two AdamW steps on 2x2 HSDP, a checkpoint of model and optimizer (streamed files), a third step
// on 1-D FSDP over the same 4 ranks from another initialization: the result is the
// uninterrupted single-process training's.
HP_DIST_TEST(StateDict, ResumeOnAnotherMeshContinuesTheTraining, 4) {
  auto world = testing::world();
  const auto options = torch::optim::AdamWOptions(1e-2);
  Mlp reference = plain_model(42);
  torch::optim::AdamW ref_opt(reference->parameters(), options);
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = batch(step);
    ref_opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    ref_opt.step();
  }

  FullyShardOptions hsdp;
  hsdp.mesh = DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
  Sharded<Mlp> first = sharded_model(42, hsdp);
  torch::optim::AdamW first_opt(first->parameters(), options);
  for (int step = 0; step < 2; ++step) step_on(first, first_opt, step);
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hp_resume_" + std::to_string(getppid())))
          .string();
  std::filesystem::create_directories(dir);
  save_full_checkpoint(*first, dir + "/model.pt");
  save_full_optimizer_checkpoint(*first, first_opt, dir + "/optim.pt");
  const StateDict optim_state = get_full_optimizer_state_dict(*first, first_opt);
  barrier(*world->world_group()).wait();

  Sharded<Mlp> resumed = sharded_model(1, {});
  torch::optim::AdamW resumed_opt(resumed->parameters(), options);
  load_full_checkpoint(*resumed, dir + "/model.pt");
  load_full_optimizer_checkpoint(*resumed, resumed_opt, dir + "/optim.pt");
  expect_equal_dicts(get_full_optimizer_state_dict(*resumed, resumed_opt), optim_state);
  EXPECT_EQ(optim_state["blocks.0.fc1.weight.step"].item<int64_t>(), 2);
  step_on(resumed, resumed_opt, 2);
  StateDict expected;
  for (const auto& item : reference->named_parameters()) expected.insert(item.key(), item.value());
  for (const auto& item : get_full_state_dict(*resumed)) {
    if (!expected.contains(item.key())) continue;  // the buffer
    EXPECT_TRUE(torch::allclose(item.value(), expected[item.key()], 0, 1e-5)) << item.key();
  }
  barrier(*world->world_group()).wait();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

HP_DIST_TEST(StateDict, SgdMomentumStateRoundTripAndOtherOptimizersRefused, 2) {
  Sharded<Mlp> model = sharded_model(42, {});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  step_on(model, opt, 0);
  const StateDict state = get_full_optimizer_state_dict(*model, opt);
  EXPECT_TRUE(state.contains("blocks.2.fc2.weight.momentum_buffer"));
  EXPECT_EQ(state["blocks.2.fc2.weight.momentum_buffer"].sizes(), torch::IntArrayRef({7, 9}));
  Sharded<Mlp> other = sharded_model(3, {});
  torch::optim::SGD other_opt(other->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  set_full_optimizer_state_dict(*other, other_opt, state);
  expect_equal_dicts(get_full_optimizer_state_dict(*other, other_opt), state);

  StateDict reshaped = state;
  reshaped["head.weight.momentum_buffer"] = torch::zeros({3});
  EXPECT_NE(error_of([&] {
              set_full_optimizer_state_dict(*other, other_opt, reshaped);
            }).find("'head.weight.momentum_buffer' has shape [3]"),
            std::string::npos);
  torch::optim::RMSprop rmsprop(model->parameters());
  EXPECT_NE(error_of([&] {
              get_full_optimizer_state_dict(*model, rmsprop);
            }).find("support torch::optim::Adam, AdamW and SGD"),
            std::string::npos);
}

// Files are what Python's torch.load reads and torch.save writes (where the Python
// torch package is installed).
HP_DIST_TEST(StateDict, PythonReadsAndWritesCheckpointFiles, 1) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("hp_state_dict_py_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string from_cpp = (dir / "from_cpp.pt").string();
  const std::string from_python = (dir / "from_python.pt").string();
  Sharded<Mlp> model = sharded_model(42, {});
  save_full_checkpoint(*model, from_cpp);
  // Python doubles every tensor and saves the dict as a PyTorch state dict; exit code 77:
  // no torch package.
  const std::string script =
      "import sys\ntry:\n import torch\nexcept ImportError:\n sys.exit(77)\n"
      "sd = torch.load('" +
      from_cpp +
      "')\n"
      "torch.save({k: 2 * v for k, v in sd.items()}, '" +
      from_python + "')\n";
  const int status = std::system(("python3 -c \"" + script + "\"").c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) GTEST_SKIP() << "no Python torch here";
  ASSERT_EQ(status, 0) << script;
  const StateDict before = get_full_state_dict(*model);
  load_full_checkpoint(*model, from_python);
  const StateDict after = get_full_state_dict(*model);
  ASSERT_EQ(after.keys(), before.keys());
  for (const auto& item : before) {
    EXPECT_TRUE(torch::equal(after[item.key()], 2 * item.value())) << item.key();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hp
