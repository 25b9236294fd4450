// Sharded checkpoints: every rank writes only its shards; a checkpoint loads on any mesh
// and world size into exactly the saved state (compared with the full state gathered
// independently); Python reads it with safetensors; damaged, incomplete and unwritable
// checkpoints are refused on every rank; a save whose rank 0 is killed at any point
// leaves a complete earlier checkpoint, never a mixed one; pipeline stages save their
// parts of the whole model.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <regex>
#include <string>

#include "checkpoint_test_util.h"
#include "cpu_memory_probe.h"
#include "error_of.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "program_run.h"
#include "shared_dir.h"
#include "stepped_checkpoint.h"

namespace hp::testing {
namespace {

namespace fs = std::filesystem;
using models::Transformer;
using testing::ProgramRun;
using testing::run_program;

// Every 2-D weight sharded on its other dim: pieces saved on dim 0 are cut across.
FullyShardOptions weights_on_dim_1() {
  FullyShardOptions options;
  options.shard_placement_fn = [](const std::string&,
                                  const at::Tensor& param) -> std::optional<Placement> {
    if (param.dim() == 2) return Placement::shard(1);
    return std::nullopt;
  };
  return options;
}

// `state` with its entries in name order.
StateDict by_name(const StateDict& state) {
  std::vector<std::string> names = state.keys();
  std::sort(names.begin(), names.end());
  StateDict sorted;
  for (const auto& name : names) sorted.insert(name, state[name]);
  return sorted;
}

// Saved on 2x2 HSDP (4 ranks), loaded on 3 ranks (1-D, weights sharded on dim 1) and on
// one: model, optimizer state and extras equal what was saved, as the full checkpoint
// functions gather it; Python assembles the same tensors from the files. Converted to
// torch.save files in one process, it gives the files the full checkpoint functions write
// (in name order), which Python's torch.load reads; a checkpoint without optimizer state
// converts the model alone.
HP_DIST_TEST(ShardedCheckpoint, LoadsOnAnyMeshAndWorldSize, 4, 3, 1) {
  auto world = testing::world();
  const std::string dir = shared_dir("hp_sharded_any_mesh");
  const std::string checkpoint = checkpoint_dir_for_step(dir, 1);
  if (world->size() == 4) {
    FullyShardOptions hsdp;
    hsdp.mesh = DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
    Sharded<Transformer> saved = sharded_transformer(42, hsdp);
    torch::optim::AdamW opt(saved->parameters(), torch::optim::AdamWOptions(1e-2));
    train_one_step(saved, opt);
    StateDict extra;
    extra.insert("step", at::scalar_tensor(1, at::kLong));
    extra.insert("data_position", torch::arange(6).reshape({2, 3}));
    save_sharded_checkpoint(checkpoint, *saved, &opt, extra);
    EXPECT_TRUE(is_complete_checkpoint(checkpoint));  // on every rank, once it returns
    // The reference, by the independent gather path.
    save_full_checkpoint(*saved, dir + "/expected_model.pt");
    save_full_optimizer_checkpoint(*saved, opt, dir + "/expected_optim.pt");
    // One copy of each shard: the second replica (ranks 2, 3) writes nothing, and the
    // two halves of the model are about the same size.
    const auto size_of = [&](int r) {
      return fs::file_size(checkpoint + "/rank-0000" + std::to_string(r) + ".safetensors");
    };
    EXPECT_LT(size_of(2), 1024u);
    EXPECT_LT(size_of(3), 1024u);
    EXPECT_GT(size_of(1), size_of(0) * 8 / 10);
    barrier(*world->world_group()).wait();  // rank 0 wrote the reference files
    return;
  }
  Sharded<Transformer> loaded =
      sharded_transformer(7, world->size() == 3 ? weights_on_dim_1() : FullyShardOptions{});
  torch::optim::AdamW opt(loaded->parameters(), torch::optim::AdamWOptions(1e-2));
  const StateDict extra = load_sharded_checkpoint(checkpoint, *loaded, &opt);
  expect_equal_dicts(get_full_state_dict(*loaded),
                     read_state_dict_file(dir + "/expected_model.pt"));
  expect_equal_dicts(get_full_optimizer_state_dict(*loaded, opt),
                     read_state_dict_file(dir + "/expected_optim.pt"));
  ASSERT_EQ(extra.keys(), (std::vector<std::string>{"data_position", "step"}));
  EXPECT_EQ(extra["step"].item<int64_t>(), 1);
  EXPECT_TRUE(torch::equal(extra["data_position"], torch::arange(6).reshape({2, 3})));
  if (world->size() == 1) {
    convert_to_full_checkpoint(checkpoint, dir + "/converted_model.pt",
                               dir + "/converted_optim.pt");
    expect_equal_dicts(read_state_dict_file(dir + "/converted_model.pt"),
                       by_name(read_state_dict_file(dir + "/expected_model.pt")));
    expect_equal_dicts(read_state_dict_file(dir + "/converted_optim.pt"),
                       by_name(read_state_dict_file(dir + "/expected_optim.pt")));
    const std::string model_only = dir + "/model_only";
    save_sharded_checkpoint(model_only, *loaded);
    const std::string refused = error_of([&] {
      convert_to_full_checkpoint(model_only, dir + "/model_only.pt", dir + "/model_only_optim.pt");
    });
    EXPECT_TRUE(contains(refused, "holds no optimizer state; pass no optimizer path")) << refused;
    EXPECT_FALSE(fs::exists(dir + "/model_only.pt"));
    const std::string one_file = error_of(
        [&] { convert_to_full_checkpoint(checkpoint, dir + "/both.pt", dir + "/./both.pt"); });
    EXPECT_TRUE(contains(one_file, "would both go to " + dir + "/both.pt; give them two files"))
        << one_file;
    EXPECT_FALSE(fs::exists(dir + "/both.pt"));
    convert_to_full_checkpoint(model_only, dir + "/model_only.pt");
    expect_equal_dicts(read_state_dict_file(dir + "/model_only.pt"),
                       by_name(read_state_dict_file(dir + "/expected_model.pt")));
    const std::string script =
        std::string("sys.path.insert(0, '") + HP_SOURCE_DIR +
        "/tools')\n"
        "import sharded_checkpoint\n"
        "model = sharded_checkpoint.load_model('" +
        checkpoint +
        "')\n"
        "expected = torch.load('" +
        dir +
        "/expected_model.pt', weights_only=True)\n"
        "assert model.keys() == expected.keys(), (model.keys(), expected.keys())\n"
        "converted = torch.load('" +
        dir +
        "/converted_model.pt', weights_only=True)\n"
        "for name, tensor in expected.items():\n"
        "    assert torch.equal(model[name], tensor), name\n"
        "    assert torch.equal(converted[name], tensor), name\n";
    EXPECT_TRUE(run_python(dir, script)) << "python3 has no torch: Python's reading untested";
    fs::remove_all(dir);
  }
}

// Layers [begin, end) of `whole` under their names in it, as a pipeline stage holds them;
// the first part also holds the embeddings, the last the final norm.
struct ModelPartImpl : torch::nn::Module {
  ModelPartImpl(Transformer& whole, int64_t begin, int64_t end, bool last) {
    if (begin == 0) {
      register_module("tok_embeddings", whole->tok_embeddings);
      register_module("pos_embeddings", whole->pos_embeddings);
    }
    auto layers = register_module("layers", std::make_shared<torch::nn::Module>());
    for (int64_t i = begin; i < end; ++i) {
      blocks.push_back(whole->layers[i]);
      layers->register_module(std::to_string(i), blocks.back().ptr());
    }
    if (last) register_module("norm", whole->norm);
  }
  std::vector<Sharded<models::DecoderBlock>> blocks;
};
TORCH_MODULE(ModelPart);

// A model split over two ranks (pipeline stages, each fully_shard-ed over its own one-rank
// mesh): each rank saves its part under the whole model's names. The checkpoint loads into
// the whole model sharded over both ranks, and back into the parts (strict: every entry is
// some rank's); an entry no rank's part holds is refused on every rank, by name. A stage's
// own buffer is written by that stage.
HP_DIST_TEST(ShardedCheckpoint, PipelineStagesSaveTheirPartsUnderTheWholeModelsNames, 2) {
  auto world = testing::world();
  const int64_t rank = world->rank();
  const std::string dir = shared_dir("hp_sharded_stages");
  const std::string checkpoint = checkpoint_dir_for_step(dir, 1);
  FullyShardOptions stage;
  stage.mesh = DeviceMesh(world, {{"pp", 2}, {"dp_shard", 1}}).slice({"dp_shard"});
  const int64_t layers = checkpoint_config().layers;
  const auto part_of = [&](int64_t begin, int64_t end) {
    torch::manual_seed(42);
    Transformer whole(checkpoint_config());
    Sharded<ModelPart> part(ModelPart(whole, begin, end, /*last=*/rank == 1));
    for (auto& block : part->blocks) fully_shard(block, stage);
    fully_shard(part, stage);
    return part;
  };
  const int64_t begin = rank == 0 ? 0 : layers / 2, end = rank == 0 ? layers / 2 : layers;
  Sharded<ModelPart> saved = part_of(begin, end);
  torch::optim::AdamW opt(saved->parameters(), torch::optim::AdamWOptions(1e-2));
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(100 + rank);
    for (at::Tensor& param : saved->parameters()) param.mutable_grad() = torch::randn_like(param);
  }
  opt.step();
  save_sharded_checkpoint(checkpoint, *saved, &opt);
  // Each part's state by the independent gather path, for the other rank too.
  const auto file = [&](const std::string& what, int64_t r) {
    return dir + "/" + what + "_" + std::to_string(r) + ".pt";
  };
  write_state_dict_file(get_full_state_dict(*saved), file("model", rank));
  write_state_dict_file(get_full_optimizer_state_dict(*saved, opt), file("optim", rank));
  barrier(*world->world_group()).wait();
  StateDict expected_model, expected_optim;
  for (int64_t r = 0; r < 2; ++r) {
    for (const auto& item : read_state_dict_file(file("model", r))) {
      expected_model.insert(item.key(), item.value());
    }
    for (const auto& item : read_state_dict_file(file("optim", r))) {
      expected_optim.insert(item.key(), item.value());
    }
  }

  Sharded<Transformer> whole = sharded_transformer(7, {});
  torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2));
  load_sharded_checkpoint(checkpoint, *whole, &whole_opt);
  expect_equal_dicts(get_full_state_dict(*whole), expected_model);
  expect_equal_dicts(get_full_optimizer_state_dict(*whole, whole_opt), expected_optim);

  Sharded<ModelPart> loaded = part_of(begin, end);
  torch::optim::AdamW loaded_opt(loaded->parameters(), torch::optim::AdamWOptions(1e-2));
  load_sharded_checkpoint(checkpoint, *loaded, &loaded_opt);
  expect_equal_dicts(get_full_state_dict(*loaded), read_state_dict_file(file("model", rank)));
  expect_equal_dicts(get_full_optimizer_state_dict(*loaded, loaded_opt),
                     read_state_dict_file(file("optim", rank)));

  // The last layer on no rank.
  Sharded<ModelPart> short_of_one = part_of(begin, rank == 0 ? end : end - 1);
  const std::string refused = error_of([&] { load_sharded_checkpoint(checkpoint, *short_of_one); });
  EXPECT_TRUE(contains(refused, "'layers." + std::to_string(layers - 1) + ".") &&
              contains(refused, "is not a parameter or buffer of the model on any rank"))
      << refused;
  EXPECT_EQ(error_of([&] {
              load_sharded_checkpoint(checkpoint, *short_of_one, nullptr, /*strict=*/false);
            }),
            "no error");

  // A buffer of stage 1's own is written by rank 1 (the lowest rank holding it) and loads
  // back there; without it on any rank, strict loading names it.
  const std::string with_buffer = checkpoint_dir_for_step(dir, 2);
  if (rank == 1) saved->register_buffer("stage_buffer", torch::arange(3, at::kFloat));
  save_sharded_checkpoint(with_buffer, *saved);
  if (rank == 1) loaded->register_buffer("stage_buffer", torch::zeros({3}));
  load_sharded_checkpoint(with_buffer, *loaded);
  if (rank == 1) {
    EXPECT_TRUE(
        torch::equal(loaded->named_buffers()["stage_buffer"], torch::arange(3, at::kFloat)));
  }
  const std::string unused =
      error_of([&] { load_sharded_checkpoint(with_buffer, *part_of(begin, end)); });
  EXPECT_TRUE(contains(unused, "'stage_buffer'") &&
              contains(unused, "is not a parameter or buffer of the model on any rank"))
      << unused;
  barrier(*world->world_group()).wait();
  if (rank == 0) fs::remove_all(dir);
}

// No rank gathers anything: saving holds no whole tensor, loading at most the pieces one
// tensor's part overlaps, and each rank's file holds its half of the model and optimizer.
HP_DIST_TEST(ShardedCheckpoint, EachRankWritesOnlyItsShards, 2) {
  auto& probe = testing::CpuMemoryProbe::installed();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  size_t largest = 0, whole_model = 0;
  for (const at::Tensor& param : models::Transformer(checkpoint_config())->parameters()) {
    largest = std::max(largest, param.nbytes());
    whole_model += param.nbytes();
  }
  const std::string dir = shared_dir("hp_sharded_memory");
  const std::string checkpoint = dir + "/checkpoint";
  int64_t before = probe.live();
  probe.reset_peak();
  save_sharded_checkpoint(checkpoint, *model, &opt);
  const int64_t save_peak = probe.peak_above(before);
  before = probe.live();
  probe.reset_peak();
  load_sharded_checkpoint(checkpoint, *model, &opt);
  const int64_t load_peak = probe.peak_above(before);
  std::printf(
      "rank %lld: whole model %lld bytes, largest tensor %lld; peak above start: save "
      "%lld, load %lld\n",
      static_cast<long long>(testing::world()->rank()), static_cast<long long>(whole_model),
      static_cast<long long>(largest), static_cast<long long>(save_peak),
      static_cast<long long>(load_peak));
  // Saving copies nothing but the step counts; loading reads the piece a tensor's part
  // lies in (half of it here) and, for optimizer state, the copy that becomes the state.
  EXPECT_LE(save_peak, 4096);
  EXPECT_LE(load_peak, static_cast<int64_t>(largest) + 4096);
  // Model + AdamW state: 3x the model over 2 ranks.
  const auto file_size = fs::file_size(checkpoint + "/rank-0000" +
                                       std::to_string(testing::world()->rank()) + ".safetensors");
  EXPECT_GT(file_size, static_cast<uintmax_t>(whole_model * 3 / 2 * 9 / 10));
  EXPECT_LT(file_size, static_cast<uintmax_t>(whole_model * 3 / 2 * 11 / 10));
  remove_after_all_ranks(dir);
}

// Flips one byte of a tensor's data in `file`, `from_end` bytes before its end.
void flip_byte(const std::string& file, std::streamoff from_end) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekg(-from_end, std::ios::end);
  char byte = 0;
  stream.read(&byte, 1);
  stream.seekp(-from_end, std::ios::end);
  byte = static_cast<char>(byte ^ 0x40);
  stream.write(&byte, 1);
}

// A damaged piece: the rank that reads it names the file and the tensor, the other rank
// names that rank. A directory without its COMPLETE marker and an unwritable place are
// refused on every rank; latest_checkpoint passes over incomplete checkpoints.
HP_DIST_TEST(ShardedCheckpoint, DamagedIncompleteAndUnwritableAreRefused, 2) {
  auto world = testing::world();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const std::string dir = shared_dir("hp_sharded_damaged");
  const std::string first = checkpoint_dir_for_step(dir, 1);
  const std::string second = checkpoint_dir_for_step(dir, 2);
  save_sharded_checkpoint(first, *model, &opt);
  save_sharded_checkpoint(second, *model, &opt);
  EXPECT_EQ(latest_checkpoint(dir), second);

  if (world->rank() == 0) flip_byte(second + "/rank-00001.safetensors", 3);
  barrier(*world->world_group()).wait();
  const std::string damaged = error_of([&] { load_sharded_checkpoint(second, *model, &opt); });
  if (world->rank() == 1) {
    EXPECT_TRUE(contains(damaged, second + "/rank-00001.safetensors")) << damaged;
    EXPECT_TRUE(contains(damaged, "is damaged")) << damaged;
    EXPECT_TRUE(contains(damaged, "tensor 'optim/")) << damaged;  // the last tensor written
  } else {
    EXPECT_TRUE(contains(damaged, "failed on rank(s) 1")) << damaged;
  }

  barrier(*world->world_group()).wait();
  if (world->rank() == 0) fs::remove(second + "/COMPLETE");
  barrier(*world->world_group()).wait();
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_TRUE(contains(error_of([&] { load_sharded_checkpoint(second, *model, &opt); }),
                       "is not a complete sharded checkpoint"));
  EXPECT_EQ(error_of([&] { load_sharded_checkpoint(first, *model, &opt); }), "no error");

  // A path below a regular file: rank 0 cannot make the directory.
  std::ofstream(dir + "/a_file") << "x";
  barrier(*world->world_group()).wait();
  const std::string unwritable = dir + "/a_file/checkpoint";
  const std::string refused = error_of([&] { save_sharded_checkpoint(unwritable, *model, &opt); });
  EXPECT_TRUE(
      contains(refused, world->rank() == 0 ? "a_file/checkpoint.partial" : "failed on rank(s) 0"))
      << refused;
  EXPECT_FALSE(is_complete_checkpoint(unwritable));
  remove_after_all_ranks(dir);
}

// A flipped bit in the first tensor of a model-only checkpoint (at the start of the data,
// far from the optimizer state the test above damages) is refused by that tensor's CRC-32.
HP_DIST_TEST(ShardedCheckpoint, AFlippedBitInTheFirstTensorIsRefused, 1) {
  Sharded<Transformer> model = sharded_transformer(42, {});
  const std::string dir = shared_dir("hp_sharded_flipped");
  const std::string checkpoint = checkpoint_dir_for_step(dir, 1);
  save_sharded_checkpoint(checkpoint, *model);
  const std::string file = checkpoint + "/rank-00000.safetensors";
  uint64_t header_bytes = 0;  // safetensors: u64 little-endian header size, header, data
  std::ifstream(file, std::ios::binary).read(reinterpret_cast<char*>(&header_bytes), 8);
  flip_byte(file, static_cast<std::streamoff>(fs::file_size(file) - (8 + header_bytes + 5)));
  const std::string damaged = error_of([&] { load_sharded_checkpoint(checkpoint, *model); });
  EXPECT_TRUE(contains(damaged, "in " + file + " is damaged: CRC-32 ")) << damaged;
  remove_after_all_ranks(dir);
}

std::string read_file(const std::string& path) {
  std::ifstream stream(path);
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

// An index that lies (one piece's offset moved back by 8 rows, as one flipped bit makes
// 128 of 120) is refused, not loaded with rows read twice and others never: its CRC-32 in
// COMPLETE no longer matches, and without that CRC the pieces no longer cover the tensor
// exactly once. latest_checkpoint passes over it to the newest intact checkpoint and says
// why.
HP_DIST_TEST(ShardedCheckpoint, ADamagedIndexIsRefusedAndPassedOver, 2) {
  auto world = testing::world();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const std::string dir = shared_dir("hp_sharded_index");
  const std::string first = checkpoint_dir_for_step(dir, 1);
  const std::string second = checkpoint_dir_for_step(dir, 2);
  save_sharded_checkpoint(first, *model, &opt);
  save_sharded_checkpoint(second, *model, &opt);
  EXPECT_TRUE(read_file(second + "/COMPLETE").starts_with("index.json crc32 "));

  if (world->rank() == 0) {
    const std::string index = read_file(second + "/index.json");
    std::smatch offset;  // the first piece that starts past row 0
    ASSERT_TRUE(std::regex_search(index, offset, std::regex("\"offsets\": \\[\\s*([1-9][0-9]*)")));
    const std::string moved = std::to_string(std::stoll(offset[1]) - 8);
    std::ofstream(second + "/index.json", std::ios::trunc)
        << offset.prefix() << offset.str().substr(0, offset.position(1) - offset.position(0))
        << moved << offset.suffix();
  }
  barrier(*world->world_group()).wait();
  const std::string damaged = error_of([&] { load_sharded_checkpoint(second, *model, &opt); });
  EXPECT_TRUE(contains(damaged, second + "/index.json is damaged: CRC-32 ")) << damaged;
  std::vector<std::string> skipped;
  EXPECT_EQ(latest_checkpoint(dir, &skipped), first);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], second + "/index.json is damaged")) << skipped[0];
  // Python's reader (tools/sharded_checkpoint.py) refuses it too, and reads the intact one.
  const bool python = world->rank() == 0;
  const auto python_reader = [&](const std::string& checkpoint) {
    return run_program("python3 " + std::string(HP_SOURCE_DIR) + "/tools/sharded_checkpoint.py " +
                       checkpoint);
  };
  if (python) {
    const ProgramRun refused = python_reader(second);
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_TRUE(contains(refused.output, second + "/index.json is damaged (CRC-32)"))
        << refused.output;
    const ProgramRun intact = python_reader(first);
    EXPECT_EQ(intact.exit_code, 0) << intact.output;
    EXPECT_TRUE(contains(intact.output, "optim/")) << intact.output;
  }

  // A marker without the CRC (as older saves wrote it): the coverage check still refuses.
  barrier(*world->world_group()).wait();
  if (world->rank() == 0) std::ofstream(second + "/COMPLETE", std::ios::trunc);
  barrier(*world->world_group()).wait();
  const std::string overlapping = error_of([&] { load_sharded_checkpoint(second, *model, &opt); });
  EXPECT_TRUE(contains(overlapping, second + "/index.json is damaged: tensor '")) << overlapping;
  EXPECT_TRUE(contains(overlapping, "overlap") || contains(overlapping, "outside")) << overlapping;
  if (python) {
    const ProgramRun refused = python_reader(second);
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_TRUE(contains(refused.output, "do not cover it once") ||
                contains(refused.output, "lies outside"))
        << refused.output;
    EXPECT_FALSE(contains(refused.output, "Traceback")) << refused.output;
  }
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_EQ(error_of([&] { load_sharded_checkpoint(first, *model, &opt); }), "no error");
  remove_after_all_ranks(dir);
}

// A complete checkpoint whose index is intact but one of whose rank files is truncated or
// missing is passed over by latest_checkpoint (its files' headers are read), naming the
// file; a piece whose bytes changed at the same size is found by the CRC pass only.
HP_DIST_TEST(ShardedCheckpoint, LatestCheckpointPassesOverMissingTruncatedOrDamagedFiles, 2) {
  auto world = testing::world();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const std::string dir = shared_dir("hp_sharded_files");
  const std::string first = checkpoint_dir_for_step(dir, 1);
  const std::string second = checkpoint_dir_for_step(dir, 2);
  save_sharded_checkpoint(first, *model, &opt);
  save_sharded_checkpoint(second, *model, &opt);
  const std::string file = second + "/rank-00001.safetensors";
  const std::string saved = read_file(file);
  // Each step changes the file on rank 0 while the others wait, then every rank looks.
  const auto on_rank0 = [&](const std::function<void()>& change) {
    barrier(*world->world_group()).wait();
    if (world->rank() == 0) change();
    barrier(*world->world_group()).wait();
  };
  const auto write = [&](const std::string& bytes) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  };
  EXPECT_EQ(latest_checkpoint(dir), second);

  on_rank0([&] { write(saved.substr(0, saved.size() / 2)); });
  std::vector<std::string> skipped;
  EXPECT_EQ(latest_checkpoint(dir, &skipped), first);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], second + " is damaged: " + file)) << skipped[0];

  on_rank0([&] { std::filesystem::remove(file); });
  skipped.clear();
  EXPECT_EQ(latest_checkpoint(dir, &skipped), first);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], "cannot open " + file)) << skipped[0];

  on_rank0([&] {
    std::string flipped = saved;
    flipped.back() = static_cast<char>(flipped.back() ^ 0x40);  // a byte of the last tensor
    write(flipped);
  });
  EXPECT_EQ(latest_checkpoint(dir), second);
  skipped.clear();
  EXPECT_EQ(latest_checkpoint(dir, &skipped, /*check_data=*/true), first);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], file + " is damaged: CRC-32")) << skipped[0];
  remove_after_all_ranks(dir);
}

// Whether a save left a directory behind (".partial" or ".old", removed by the next save
// to that name) that was written to after `since`.
bool save_interrupted_since(const fs::path& root, fs::file_time_type since) {
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if ((name.ends_with(".partial") || name.ends_with(".old")) &&
        fs::last_write_time(entry.path()) >= since) {
      return true;
    }
  }
  return false;
}

// Two ranks saving one checkpoint after the other (each its shards; with `async`, through
// an AsyncCheckpointSaver) have rank 0 killed (SIGKILL) at `kills` random moments, hp-run
// then stopping the other: the newest complete checkpoint always loads, whole and from one
// step.
void expect_killed_saves_leave_a_complete_checkpoint(bool async, int kills) {
  const fs::path root = fs::temp_directory_path() / ("hp_sharded_kill_" + std::to_string(getpid()));
  fs::remove_all(root);
  const std::string log_path = root.string() + ".log";
  torch::nn::Sequential model = stepped_model();
  save_step(model, root.string(), 1);
  std::mt19937 random(2026);
  int interrupted = 0;
  for (int kill_number = 0; kill_number < kills; ++kill_number) {
    const std::optional<std::string> before = latest_checkpoint(root.string());
    const fs::file_time_type started = fs::file_time_type::clock::now();
    ASSERT_TRUE(before.has_value());
    const int64_t next = std::stoll(fs::path(*before).filename().string().substr(5)) + 1;
    // Fresh processes: a forked child of this multithreaded one could deadlock.
    const std::string first_step = std::to_string(next);
    const fs::path pid_file = root / "rank0.pid";
    fs::remove(pid_file);
    const pid_t launcher = fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
      // This round's output only (not every round's "rank 0 was killed"): shown if it fails.
      const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(log, STDOUT_FILENO);
      dup2(log, STDERR_FILENO);
      execl(HP_RUN_PATH, HP_RUN_PATH, "-n", "2", "--", HP_SAVER_PATH, root.c_str(),
            first_step.c_str(), async ? "--async" : nullptr, nullptr);
      _exit(127);
    }
    // Rank 0 killed once the ranks save (LibTorch takes a while to load), at a random
    // moment after. A saver that exits first fails the round at once, with its output; one
    // that hangs fails it at a deadline per phase (start-up, then one save), and is stopped.
    const auto wait_for = [&](const std::string& phase, int seconds,
                              const std::function<bool()>& done) -> std::optional<std::string> {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
      while (!done()) {
        int status = 0;
        if (waitpid(launcher, &status, WNOHANG) == launcher) {
          return "the saver exited during " + phase + " (status " + std::to_string(status) +
                 "):\n" + read_file(log_path);
        }
        if (std::chrono::steady_clock::now() > deadline) {
          kill(launcher, SIGTERM);  // hp-run stops its ranks
          waitpid(launcher, &status, 0);
          return "the saver did not finish " + phase + " within " + std::to_string(seconds) +
                 " s:\n" + read_file(log_path);
        }
        usleep(5000);
      }
      return std::nullopt;
    };
    std::optional<std::string> failure =
        wait_for("start-up", 120, [&] { return fs::exists(pid_file); });
    if (!failure) {
      failure = wait_for("a save", 60, [&] { return latest_checkpoint(root.string()) != before; });
    }
    ASSERT_FALSE(failure.has_value()) << "round " << kill_number << ": " << *failure;
    usleep(std::uniform_int_distribution<useconds_t>(0, 100000)(random));
    pid_t rank0 = 0;
    std::ifstream(pid_file) >> rank0;
    ASSERT_GT(rank0, 0);
    kill(rank0, SIGKILL);
    int status = 0;
    waitpid(launcher, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "hp-run saw rank 0 killed";
    interrupted += save_interrupted_since(root, started);

    const std::optional<std::string> latest = latest_checkpoint(root.string());
    ASSERT_TRUE(latest.has_value()) << "kill " << kill_number << " left no complete checkpoint";
    torch::nn::Sequential loaded = stepped_model();
    const StateDict extra = load_sharded_checkpoint(*latest, *loaded);
    const int64_t step = extra["step"].item<int64_t>();
    EXPECT_EQ(*latest, checkpoint_dir_for_step(root.string(), step));
    for (const auto& param : loaded->parameters()) {
      EXPECT_TRUE(torch::all(param == static_cast<double>(step)).item<bool>())
          << *latest << " mixes steps";
    }
  }
  std::printf("kills that interrupted a save: %d of %d\n", interrupted, kills);
  EXPECT_GT(interrupted, 0) << "no kill landed inside a save: the test proved nothing";
  fs::remove_all(root);
  fs::remove(log_path);
}

TEST(ShardedCheckpoint, KilledSaveLeavesACompleteCheckpoint) {
  expect_killed_saves_leave_a_complete_checkpoint(/*async=*/false, 20);
}

// The same with the writes in the background: a rank killed while its writer thread runs
// leaves the previous checkpoint intact and the new one unloaded.
TEST(ShardedCheckpoint, KilledAsyncSaveLeavesACompleteCheckpoint) {
  expect_killed_saves_leave_a_complete_checkpoint(/*async=*/true, 10);
}

}  // namespace
}  // namespace hp::testing
