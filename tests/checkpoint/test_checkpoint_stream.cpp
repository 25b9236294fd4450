// Streamed full checkpoints: model and optimizer saved one gathered tensor at a time and
// loaded one read tensor at a time, across meshes, within a few tensors of memory, in
// files Python's torch reads and writes, with errors that name the file and the tensor.
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "checkpoint_test_util.h"
#include "cpu_memory_probe.h"
#include "distributed_test.h"
#include "error_of.h"
#include "fsdp_test_util.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/state_dict.h"
#include "models/transformer.h"
#include "shared_dir.h"

namespace hp {
namespace {

using models::Transformer;
using testing::checkpoint_config;
using testing::contains;
using testing::error_of;
using testing::expect_equal_dicts;
using testing::remove_after_all_ranks;
using testing::run_python;
using testing::sharded_transformer;
using testing::shared_dir;
using testing::train_one_step;

// Saved on FSDP over 2 ranks or 2x2 HSDP, loaded where every weight matrix is sharded on
// its other dim, and into the plain model: the full state is the saved one.
HP_DIST_TEST(CheckpointStream, ModelAndOptimizerRoundTripAcrossMeshes, 2, 4) {
  auto world = testing::world();
  FullyShardOptions saved_options;
  if (world->size() == 4) {
    saved_options.mesh = DeviceMesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
  }
  Sharded<Transformer> saved = sharded_transformer(42, saved_options);
  torch::optim::AdamW saved_opt(saved->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(saved, saved_opt);
  const std::string dir = shared_dir("hp_stream_round_trip");
  save_full_checkpoint(*saved, dir + "/model.pt");
  save_full_optimizer_checkpoint(*saved, saved_opt, dir + "/optim.pt");
  barrier(*world->world_group()).wait();  // rank 0 wrote them

  FullyShardOptions other_mesh;
  other_mesh.shard_placement_fn = [](const std::string&,
                                     const at::Tensor& param) -> std::optional<Placement> {
    if (param.dim() == 2) return Placement::shard(1);
    return std::nullopt;
  };
  Sharded<Transformer> loaded = sharded_transformer(7, other_mesh);
  torch::optim::AdamW loaded_opt(loaded->parameters(), torch::optim::AdamWOptions(1e-2));
  load_full_checkpoint(*loaded, dir + "/model.pt");
  load_full_optimizer_checkpoint(*loaded, loaded_opt, dir + "/optim.pt");
  const StateDict expected = get_full_state_dict(*saved);
  expect_equal_dicts(get_full_state_dict(*loaded), expected);
  expect_equal_dicts(get_full_optimizer_state_dict(*loaded, loaded_opt),
                     get_full_optimizer_state_dict(*saved, saved_opt));

  torch::manual_seed(3);
  Transformer plain(checkpoint_config());
  load_full_checkpoint(*plain, dir + "/model.pt");
  for (const auto& item : plain->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
  }
  remove_after_all_ranks(dir);
}

// Peak live host bytes above the start of each save and load, on every rank.
HP_DIST_TEST(CheckpointStream, PeakMemoryIsAFewTensorsNotTheModel, 2) {
  auto& probe = testing::CpuMemoryProbe::installed();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  int64_t largest = 0, whole_model = 0;
  torch::manual_seed(42);
  Transformer plain(checkpoint_config());
  for (const auto& item : plain->named_parameters()) {
    largest = std::max<int64_t>(largest, item.value().nbytes());
    whole_model += item.value().nbytes();
  }
  ASSERT_GE(whole_model, 30 * largest);

  auto peak_of = [&](const std::function<void()>& call) {
    const int64_t before = probe.live();
    probe.reset_peak();
    call();
    return probe.peak_above(before);
  };
  const std::string dir = shared_dir("hp_stream_memory");
  const int64_t save_model = peak_of([&] { save_full_checkpoint(*model, dir + "/model.pt"); });
  const int64_t save_optim =
      peak_of([&] { save_full_optimizer_checkpoint(*model, opt, dir + "/optim.pt"); });
  barrier(*testing::world()->world_group()).wait();
  const int64_t load_model = peak_of([&] { load_full_checkpoint(*model, dir + "/model.pt"); });
  const int64_t load_optim =
      peak_of([&] { load_full_optimizer_checkpoint(*model, opt, dir + "/optim.pt"); });
  std::printf(
      "rank %lld: whole model %lld bytes (optimizer state 2x that), largest tensor %lld; peak "
      "above start: save model %lld, save optimizer %lld, load model %lld, load optimizer "
      "%lld\n",
      static_cast<long long>(testing::world()->rank()), static_cast<long long>(whole_model),
      static_cast<long long>(largest), static_cast<long long>(save_model),
      static_cast<long long>(save_optim), static_cast<long long>(load_model),
      static_cast<long long>(load_optim));
  // Saving one tensor holds the all-gather output and Gloo's flat receive buffer (each
  // the whole tensor), then that output and the whole tensor cut from it; optimizer state
  // adds the padded local part it sends (half a tensor on 2 ranks): 2.5 tensors. Each of
  // Gloo's two worker threads may still hold a completed gather's tensors for a while
  // (descheduled on a loaded machine): the input and any intermediate are freed as soon
  // as the gather is done, the output is the whole tensor handed out, so at most 2 more:
  // 4.5 tensors (5 allow for the few bytes of step counts and flags). Loading holds the tensor read
  // and, for optimizer state, this rank's copy of its part.
  const int64_t small_tensors = 4096;
  for (int64_t peak : {save_model, save_optim}) EXPECT_LE(peak, 5 * largest + small_tensors);
  for (int64_t peak : {load_model, load_optim}) EXPECT_LE(peak, 2 * largest + small_tensors);
  for (int64_t peak : {save_model, save_optim, load_model, load_optim}) {
    EXPECT_LT(peak, whole_model / 5);
  }
  remove_after_all_ranks(dir);
}

// Python's torch.load (weights_only) reads what the streaming writer wrote, dtypes,
// empty and non-contiguous tensors included; the reader takes Python's views that share
// one storage (offsets, strides) and state dicts saved as plain dicts.
HP_DIST_TEST(CheckpointStream, PythonReadsAndWritesStreamedFiles, 1) {
  const std::string dir = shared_dir("hp_stream_python");
  StateDict mixed;
  mixed.insert("float", torch::arange(12, torch::kFloat).reshape({3, 4}));
  mixed.insert("transposed", torch::arange(6, torch::kDouble).reshape({2, 3}).t());
  mixed.insert("bf16", torch::linspace(-1, 1, 5).to(torch::kBFloat16));
  mixed.insert("step", torch::scalar_tensor(7, torch::kLong));
  mixed.insert("empty", torch::zeros({0, 3}));
  write_state_dict_file(mixed, dir + "/mixed.pt");
  const bool has_torch = run_python(dir, R"(
sd = torch.load(sys.argv[0].replace('check.py', 'mixed.pt'))
assert list(sd) == ['float', 'transposed', 'bf16', 'step', 'empty'], list(sd)
assert torch.equal(sd['float'], torch.arange(12.).reshape(3, 4))
assert torch.equal(sd['transposed'], torch.arange(6, dtype=torch.double).reshape(2, 3).t())
assert sd['bf16'].dtype == torch.bfloat16 and sd['step'].item() == 7
assert sd['empty'].shape == (0, 3)
base = torch.arange(20.)
torch.save({'whole': base, 'tail': base[5:], 'matrix_t': base[:12].view(3, 4).t()},
           sys.argv[0].replace('check.py', 'views.pt'))
model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
torch.save(model.state_dict(), sys.argv[0].replace('check.py', 'ordered.pt'))
torch.save(dict(model.state_dict()), sys.argv[0].replace('check.py', 'plain.pt'))
)");
  if (!has_torch) GTEST_SKIP() << "no Python torch here";
  const StateDict views = read_state_dict_file(dir + "/views.pt");
  const at::Tensor base = torch::arange(20, torch::kFloat);
  EXPECT_TRUE(torch::equal(views["whole"], base));
  EXPECT_TRUE(torch::equal(views["tail"], base.narrow(0, 5, 15)));
  EXPECT_TRUE(torch::equal(views["matrix_t"], base.narrow(0, 0, 12).view({3, 4}).t()));
  // LibTorch's unpickler cannot read Python's OrderedDict: the error says what to save.
  const std::string ordered = error_of([&] { read_state_dict_file(dir + "/ordered.pt"); });
  EXPECT_TRUE(contains(ordered, "torch.save(dict(model.state_dict()), path)")) << ordered;
  EXPECT_EQ(read_state_dict_file(dir + "/plain.pt").keys(),
            (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                      "1.running_var", "1.num_batches_tracked"}));
  std::filesystem::remove_all(dir);
}

// A missing, truncated or damaged file, a missing name, a wrong shape, an extra name:
// errors name the file and the tensor, and the model and optimizer stay unchanged when
// the names and shapes tell.
HP_DIST_TEST(CheckpointStream, BadFilesAreRefusedWithTheirNames, 2) {
  auto world = testing::world();
  Sharded<Transformer> model = sharded_transformer(42, {});
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  train_one_step(model, opt);
  const StateDict good = get_full_state_dict(*model);
  const StateDict good_optim = get_full_optimizer_state_dict(*model, opt);
  const std::string dir = shared_dir("hp_stream_errors");
  const std::string path = dir + "/model.pt";
  save_full_checkpoint(*model, path);
  if (world->rank() == 0) {
    StateDict missing = good;
    missing.erase("layers.3.mlp.w2.weight");
    write_state_dict_file(missing, dir + "/missing.pt");
    StateDict reshaped = good;
    reshaped["norm.weight"] = torch::zeros({3});
    write_state_dict_file(reshaped, dir + "/reshaped.pt");
    StateDict extra = good;
    extra.insert("head.gain", torch::ones({3}));
    write_state_dict_file(extra, dir + "/extra.pt");
    StateDict optim_reshaped = good_optim;
    optim_reshaped["layers.0.attn.wq.weight.exp_avg"] = torch::zeros({64});
    write_state_dict_file(optim_reshaped, dir + "/optim_reshaped.pt");
    std::filesystem::copy_file(path, dir + "/truncated.pt");
    std::filesystem::resize_file(dir + "/truncated.pt", std::filesystem::file_size(path) / 2);
  }
  barrier(*world->world_group()).wait();

  const std::string absent = error_of([&] { load_full_checkpoint(*model, dir + "/absent.pt"); });
  EXPECT_TRUE(contains(absent, dir + "/absent.pt") && contains(absent, "No such file")) << absent;
  const std::string truncated =
      error_of([&] { load_full_checkpoint(*model, dir + "/truncated.pt"); });
  EXPECT_TRUE(contains(truncated, dir + "/truncated.pt is not a torch.save zip archive"))
      << truncated;
  const std::string missing = error_of([&] { load_full_checkpoint(*model, dir + "/missing.pt"); });
  EXPECT_TRUE(contains(
      missing, "no entry for 'layers.3.mlp.w2.weight' in checkpoint file " + dir + "/missing.pt"))
      << missing;
  const std::string reshaped =
      error_of([&] { load_full_checkpoint(*model, dir + "/reshaped.pt"); });
  EXPECT_TRUE(contains(reshaped, "'norm.weight' has shape [3] in checkpoint file " + dir +
                                     "/reshaped.pt, the model's is [64]"))
      << reshaped;
  const std::string extra = error_of([&] { load_full_checkpoint(*model, dir + "/extra.pt"); });
  EXPECT_TRUE(contains(extra,
                       "'head.gain' is not a parameter or buffer of the model, but "
                       "checkpoint file " +
                           dir + "/extra.pt has it"))
      << extra;
  EXPECT_EQ(error_of([&] { load_full_checkpoint(*model, dir + "/extra.pt", /*strict=*/false); }),
            "no error");
  const std::string optim_reshaped =
      error_of([&] { load_full_optimizer_checkpoint(*model, opt, dir + "/optim_reshaped.pt"); });
  EXPECT_TRUE(contains(optim_reshaped,
                       "'layers.0.attn.wq.weight.exp_avg' has shape [64] in "
                       "checkpoint file " +
                           dir + "/optim_reshaped.pt"))
      << optim_reshaped;
  expect_equal_dicts(get_full_state_dict(*model), good);
  expect_equal_dicts(get_full_optimizer_state_dict(*model, opt), good_optim);
  remove_after_all_ranks(dir);
}

// A record whose bytes cannot be read (its local zip header overwritten) is found only
// when it is read: the error names the file and the tensor and says what was loaded.
HP_DIST_TEST(CheckpointStream, UnreadableRecordNamesTheTensor, 1) {
  Sharded<Transformer> model = sharded_transformer(42, {});
  const std::string dir = shared_dir("hp_stream_damaged");
  const std::string path = dir + "/model.pt";
  save_full_checkpoint(*model, path);
  // Python's zipfile (no torch needed) finds where the record of entry 5 starts.
  const std::string script = "import zipfile, sys\nz = zipfile.ZipFile('" + path +
                             "')\nprint([i.header_offset for i in z.infolist() if "
                             "i.filename.endswith('/data/5')][0])\n";
  FILE* pipe = popen(("python3 -c \"" + script + "\"").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  long long offset = -1;
  const int parsed = std::fscanf(pipe, "%lld", &offset);
  pclose(pipe);
  if (parsed != 1) GTEST_SKIP() << "no python3 here";
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(offset);
    file.write("XXXX", 4);  // the local header's signature
  }
  const std::string name = model->named_parameters().keys()[5];
  const std::string error = error_of([&] { load_full_checkpoint(*model, path); });
  EXPECT_TRUE(contains(error, "cannot read '" + name + "' from " + path)) << error;
  EXPECT_TRUE(contains(error, "the model is partly loaded")) << error;
  std::filesystem::remove_all(dir);
}

// Flipped bits in a tensor's bytes (the zip structure intact) fail the CRC-32 the archive
// stores for the record: the error names the file and the tensor; nothing loads silently.
HP_DIST_TEST(CheckpointStream, FlippedTensorBytesFailTheCrcCheck, 1) {
  Sharded<Transformer> model = sharded_transformer(42, {});
  const std::string dir = shared_dir("hp_stream_flipped");
  const std::string path = dir + "/model.pt";
  save_full_checkpoint(*model, path);
  const std::string name = model->named_parameters().keys()[5];
  const at::Tensor whole = get_full_state_dict(*model)[name].contiguous();
  std::string bytes;
  {
    std::ifstream file(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  const std::string pattern(static_cast<const char*>(whole.data_ptr()), 64);
  const size_t at = bytes.find(pattern);
  ASSERT_NE(at, std::string::npos) << "the tensor's bytes are stored uncompressed";
  bytes[at + 33] = static_cast<char>(bytes[at + 33] ^ 0x10);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const std::string error = error_of([&] { load_full_checkpoint(*model, path); });
  EXPECT_TRUE(contains(error, "cannot read '" + name + "' from " + path)) << error;
  EXPECT_TRUE(contains(error, "fail the CRC-32 check (the file is damaged)")) << error;
  std::filesystem::remove_all(dir);
}

// A damaged byte-order record (or a damaged central directory pointing the reader at other
// bytes) is a damaged file, not "another byte order": the record fails its CRC-32 first.
HP_DIST_TEST(CheckpointStream, ADamagedByteOrderRecordIsNamedAsDamage, 1) {
  Sharded<Transformer> model = sharded_transformer(42, {});
  const std::string dir = shared_dir("hp_stream_byteorder");
  const std::string path = dir + "/model.pt";
  save_full_checkpoint(*model, path);
  std::string bytes;
  {
    std::ifstream file(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  const size_t at = bytes.find("little");
  ASSERT_NE(at, std::string::npos) << "the byte-order record is stored uncompressed";
  bytes[at + 2] = 'x';
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const std::string error = error_of([&] { load_full_checkpoint(*model, path); });
  EXPECT_TRUE(contains(error, path + ": its record 'byteorder' fails the CRC-32 check (the file "
                                     "is damaged)"))
      << error;
  EXPECT_FALSE(contains(error, "byte order than")) << error;
  std::filesystem::remove_all(dir);
}

// Saving where the file cannot be created throws on the writing rank after the gathers
// (the other rank is not left waiting); a write that fails mid-file throws naming the
// file and the tensor, and leaves no file behind.
HP_DIST_TEST(CheckpointStream, WriteErrorsThrowOnTheWritingRankAndLeaveNoFile, 2) {
  auto world = testing::world();
  Sharded<Transformer> model = sharded_transformer(42, {});
  const std::string dir = shared_dir("hp_stream_write_errors");
  const std::string unwritable = dir + "/no/such/dir/model.pt";
  const std::string error = error_of([&] { save_full_checkpoint(*model, unwritable); });
  if (world->rank() == 0) {
    EXPECT_TRUE(
        contains(error, "save_full_checkpoint: cannot create checkpoint file " + unwritable))
        << error;
  } else {
    EXPECT_EQ(error, "no error");
  }
  barrier(*world->world_group()).wait();

  // At most 64 KiB per file: the limit is hit inside the model's records.
  const std::string path = dir + "/too_large.pt";
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old_limit{};
  getrlimit(RLIMIT_FSIZE, &old_limit);
  rlimit small = old_limit;
  small.rlim_cur = 64 << 10;
  setrlimit(RLIMIT_FSIZE, &small);
  const std::string too_large = error_of([&] { save_full_checkpoint(*model, path); });
  setrlimit(RLIMIT_FSIZE, &old_limit);
  if (world->rank() == 0) {
    EXPECT_TRUE(contains(too_large, "save_full_checkpoint: cannot write '")) << too_large;
    EXPECT_TRUE(contains(too_large, "to checkpoint file " + path + ": File too large"))
        << too_large;
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  } else {
    EXPECT_EQ(too_large, "no error");
  }
  remove_after_all_ranks(dir);
}

}  // namespace
}  // namespace hp
