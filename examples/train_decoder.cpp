// Trains the decoder-only transformer of models/transformer.h with fully_shard (HSDP on
// a 2x2 mesh by default) on a synthetic copy task: the second half of every sequence
// repeats the first half, so those next tokens are predictable only by attending back
// half a sequence. Loss and accuracy count the predictable positions only; chance
// accuracy is 1/vocab. Exits 0 only if the loss fell below half its first value.
//   hp-run -n 4 -- build/examples/train_decoder [--steps N] [--mesh RxS] ... (--help)
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "hyperparallel/checkpoint.h"
#include "hyperparallel/clip_grad.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "hyperparallel/trace.h"
#include "models/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: hp-run -n 4 -- train_decoder [options]\n"
    "\n"
    "Trains a small decoder-only transformer with fully_shard on a copy task (the second\n"
    "half of each sequence repeats the first). Exits 0 if the loss fell below half of its\n"
    "first value, 1 otherwise.\n"
    "\n"
    "options:\n"
    "  --steps N        optimizer steps (default 300)\n"
    "  --batch N        global batch in sequences, divisible by the number of ranks (32)\n"
    "  --seq N          sequence length, even, >= 4 (32)\n"
    "  --dim N          model width (64)\n"
    "  --layers N       decoder blocks (2)\n"
    "  --heads N        attention heads, must divide --dim (4)\n"
    "  --vocab N        vocabulary size, >= 2 (64)\n"
    "  --lr X           AdamW learning rate (3e-3)\n"
    "  --clip-grad X    clip the gradients to global norm X before each step; 0: off (1.0)\n"
    "  --mesh RxS       R replicas x S shards = number of ranks; R=1 is plain FSDP (2x2)\n"
    "  --mp none|bf16   bf16: parameters gathered and used in bf16, gradients reduced in\n"
    "                   fp32 (none)\n"
    "  --comm-fusion    one all-gather / reduce-scatter per module instead of per parameter\n"
    "  --checkpoint none|reentrant|non-reentrant\n"
    "                   activation checkpointing of every decoder block (none)\n"
    "  --seed N         model initialization and data (0)\n"
    "  --save DIR       write sharded checkpoints (model, optimizer, step, RNG, losses) as\n"
    "                   DIR/step-<N>, every rank its own shards; at the end, and every\n"
    "                   --save-every steps\n"
    "  --save-every N   also save after every N-th step (0: only at the end) (0)\n"
    "  --resume auto|PATH\n"
    "                   auto: continue from the newest complete checkpoint under --save DIR\n"
    "                   (a fresh start when there is none); PATH: from that sharded\n"
    "                   checkpoint, or from an --export directory (any --mesh). --steps is\n"
    "                   the total: a resumed run ends where an uninterrupted one would,\n"
    "                   with the same parameters bit for bit\n"
    "  --export DIR     at the end, write DIR/model.pt and DIR/optim.pt (whole tensors,\n"
    "                   readable by Python's torch.load)\n"
    "  --fail-at-step N fault injection for restart tests: the last rank exits with an\n"
    "                   error before step N, in the first attempt only (hp-run and torchrun\n"
    "                   set TORCHELASTIC_RESTART_COUNT on restarts)\n"
    "  --trace DIR      record step 3 of every rank as DIR/trace_rank<R>.json (Chrome trace)\n"
    "                   and DIR/timeline_rank<R>.svg\n"
    "  -h, --help       show this help\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  int64_t steps = 300;
  int64_t batch = 32;
  int64_t seq = 32;
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t vocab = 64;
  double lr = 3e-3;
  double clip_grad = 1.0;  // 0: no clipping
  int64_t replicate = 2;
  int64_t shard = 2;
  bool bf16 = false;
  bool comm_fusion = false;
  std::optional<hp::CheckpointImpl> checkpoint;
  int64_t seed = 0;
  std::string save_dir;      // empty: no checkpoint written
  int64_t save_every = 0;    // 0: only at the end
  std::string resume;        // empty: fresh start; "auto" or a checkpoint
  std::string export_dir;    // empty: no full export
  int64_t fail_at_step = 0;  // 0: never
  std::string trace_dir;     // empty: no trace
  bool help = false;
};

void write_trace(const std::string& dir, int64_t rank,
                 const std::vector<hp::trace::Event>& events) {
  std::filesystem::create_directories(dir);
  const std::string suffix = "_rank" + std::to_string(rank);
  std::ofstream(dir + "/trace" + suffix + ".json") << hp::trace::to_chrome_json(events, rank);
  std::ofstream(dir + "/timeline" + suffix + ".svg") << hp::trace::to_svg(
      events, "train_decoder, one training step, rank " + std::to_string(rank));
}

int64_t parse_int(std::string_view flag, std::string_view text, int64_t min, int64_t max) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
    throw UsageError(std::string(flag) + " needs an integer in " + std::to_string(min) + ".." +
                     std::to_string(max) + ", got '" + std::string(text) + "'");
  }
  return value;
}

double parse_positive(std::string_view flag, std::string_view text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !(value > 0) ||
      !std::isfinite(value)) {
    throw UsageError(std::string(flag) + " needs a positive number, got '" + std::string(text) +
                     "'");
  }
  return value;
}

// "RxS", e.g. "2x2" or "1x4".
std::pair<int64_t, int64_t> parse_mesh(std::string_view text) {
  const size_t x = text.find('x');
  if (x == std::string_view::npos) {
    throw UsageError("--mesh needs RxS (replicas x shards, e.g. 2x2 or 1x4), got '" +
                     std::string(text) + "'");
  }
  return {parse_int("--mesh R", text.substr(0, x), 1, 1 << 16),
          parse_int("--mesh S", text.substr(x + 1), 1, 1 << 16)};
}

// Accepts "--flag value" and "--flag=value".
Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::optional<std::string_view> inline_value;
    if (const size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(std::string(arg) + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      o.help = true;
    } else if (arg == "--comm-fusion") {
      if (inline_value) throw UsageError("--comm-fusion takes no value");
      o.comm_fusion = true;
    } else if (arg == "--steps") {
      o.steps = parse_int(arg, value(), 1, 1'000'000);
    } else if (arg == "--batch") {
      o.batch = parse_int(arg, value(), 1, 1 << 20);
    } else if (arg == "--seq") {
      o.seq = parse_int(arg, value(), 4, 1 << 16);
    } else if (arg == "--dim") {
      o.dim = parse_int(arg, value(), 1, 1 << 16);
    } else if (arg == "--layers") {
      o.layers = parse_int(arg, value(), 1, 1024);
    } else if (arg == "--heads") {
      o.heads = parse_int(arg, value(), 1, 1 << 16);
    } else if (arg == "--vocab") {
      o.vocab = parse_int(arg, value(), 2, 1 << 24);
    } else if (arg == "--lr") {
      o.lr = parse_positive(arg, value());
    } else if (arg == "--clip-grad") {
      const std::string_view text = value();
      o.clip_grad = text == "0" ? 0.0 : parse_positive(arg, text);
    } else if (arg == "--mesh") {
      std::tie(o.replicate, o.shard) = parse_mesh(value());
    } else if (arg == "--mp") {
      const std::string_view mp = value();
      if (mp != "none" && mp != "bf16") {
        throw UsageError("--mp needs none or bf16, got '" + std::string(mp) + "'");
      }
      o.bf16 = mp == "bf16";
    } else if (arg == "--checkpoint") {
      const std::string_view kind = value();
      if (kind == "reentrant") {
        o.checkpoint = hp::CheckpointImpl::kReentrant;
      } else if (kind == "non-reentrant") {
        o.checkpoint = hp::CheckpointImpl::kNonReentrant;
      } else if (kind != "none") {
        throw UsageError("--checkpoint needs none, reentrant or non-reentrant, got '" +
                         std::string(kind) + "'");
      }
    } else if (arg == "--save") {
      o.save_dir = value();
    } else if (arg == "--save-every") {
      o.save_every = parse_int(arg, value(), 0, 1'000'000);
    } else if (arg == "--resume") {
      o.resume = value();
    } else if (arg == "--export") {
      o.export_dir = value();
    } else if (arg == "--fail-at-step") {
      o.fail_at_step = parse_int(arg, value(), 1, 1'000'000);
    } else if (arg == "--trace") {
      o.trace_dir = std::string(value());
    } else if (arg == "--seed") {
      o.seed = parse_int(arg, value(), 0, int64_t{1} << 40);
    } else {
      throw UsageError("unknown option '" + std::string(argv[i]) + "'");
    }
  }
  if (o.seq % 2 != 0) throw UsageError("--seq must be even, got " + std::to_string(o.seq));
  if (o.resume == "auto" && o.save_dir.empty()) {
    throw UsageError("--resume auto needs --save DIR (the checkpoints it looks for)");
  }
  if (o.save_every > 0 && o.save_dir.empty()) {
    throw UsageError("--save-every needs --save DIR");
  }
  if (o.dim % o.heads != 0) {
    throw UsageError("--heads (" + std::to_string(o.heads) + ") must divide --dim (" +
                     std::to_string(o.dim) + ")");
  }
  return o;
}

// One data-parallel rank's sequences of a step. The global batch depends only on the
// seed and the step, so every mesh shape trains on the same data.
struct Batch {
  at::Tensor input;   // [b, seq - 1]
  at::Tensor target;  // [b, seq - 1]: input shifted by one
};

Batch make_batch(const Options& o, int64_t step, int64_t rank, int64_t ranks) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(o.seed) * 1'000'003 +
                                                     static_cast<uint64_t>(step));
  at::Tensor half = torch::randint(o.vocab, {o.batch, o.seq / 2}, gen, torch::kLong);
  at::Tensor mine = torch::cat({half, half}, 1).chunk(ranks, 0)[rank];
  return {mine.narrow(1, 0, o.seq - 1), mine.narrow(1, 1, o.seq - 1)};
}

// Targets from index seq/2 - 1 on are copies of earlier tokens.
at::Tensor predictable(const at::Tensor& t, int64_t seq) {
  return t.narrow(1, seq / 2 - 1, seq / 2);
}

// Peak resident set size of this process (VmHWM), in MiB.
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmHWM:")) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return 0;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

int64_t numel_of(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

// Fails before training, on every rank, when rank 0 cannot write into `dir` (a write
// error at the first save would waste the steps before it).
void check_writable(const std::string& flag, const std::string& dir, int64_t rank,
                    const hp::Group& all) {
  std::string problem;
  if (rank == 0) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    const std::string probe = dir + "/.write-test";
    if (error) {
      problem = error.message();
    } else if (!(std::ofstream(probe) << "x")) {
      problem = "cannot create files in it";
    }
    std::filesystem::remove(probe, error);
  }
  at::Tensor failed = torch::full({1}, problem.empty() ? 0 : 1, torch::kInt);
  hp::all_reduce(failed, hp::ReduceOp::kMax, all).wait();
  if (failed.item<int>() != 0) {
    throw UsageError(flag + " " + dir + ": rank 0 cannot write there" +
                     (problem.empty() ? "" : " (" + problem + ")") + "; pick a writable directory");
  }
}

// What a resumed run needs besides the model and the optimizer, saved with them: the
// steps taken, every rank's random generator state and the losses so far (so that its
// summary is the uninterrupted run's).
hp::StateDict run_state(int64_t step, const std::vector<double>& losses,
                        const std::vector<double>& accuracies, const hp::Group& all,
                        int64_t ranks) {
  at::Tensor rng;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng = generator.get_state();
  }
  at::Tensor every_rng = torch::empty({ranks * rng.numel()}, rng.options());
  hp::all_gather(every_rng, rng, all).wait();
  hp::StateDict state;
  state.insert("step", at::scalar_tensor(step, at::kLong));
  state.insert("rng_states", every_rng.view({ranks, rng.numel()}));
  state.insert("losses", torch::tensor(losses, torch::kDouble));
  state.insert("accuracies", torch::tensor(accuracies, torch::kDouble));
  return state;
}

std::vector<double> to_vector(const at::Tensor& values) {
  const at::Tensor contiguous = values.to(at::kDouble).contiguous();
  return {contiguous.data_ptr<double>(), contiguous.data_ptr<double>() + contiguous.numel()};
}

// This rank's generator state from a checkpoint; saved on another number of ranks, rank r
// takes row r modulo theirs.
void restore_rng(const at::Tensor& states, int64_t rank) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(states[rank % states.size(0)].clone());
}

int train(const Options& o) {
  std::shared_ptr<hp::World> world = hp::default_world();
  const hp::Group& all = *world->world_group();
  const int64_t ranks = world->size(), rank = world->rank();
  if (o.replicate * o.shard != ranks) {
    throw UsageError("--mesh " + std::to_string(o.replicate) + "x" + std::to_string(o.shard) +
                     " needs " + std::to_string(o.replicate * o.shard) + " ranks, this run has " +
                     std::to_string(ranks) + " (use hp-run -n " +
                     std::to_string(o.replicate * o.shard) + ", or --mesh 1x" +
                     std::to_string(ranks) + ")");
  }
  if (o.batch % ranks != 0) {
    throw UsageError("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                     std::to_string(ranks) + " data-parallel ranks");
  }

  hp::models::TransformerConfig config;
  config.vocab = o.vocab;
  config.dim = o.dim;
  config.heads = o.heads;
  config.layers = o.layers;
  config.ffn_hidden = 4 * o.dim;
  config.max_seq = o.seq;
  torch::manual_seed(o.seed);  // the same initial model on every rank
  // Recorded, not allocated: no rank ever holds the whole model; each materializes (or
  // loads) only its shards, below.
  auto model = hp::deferred_init([&] { return hp::Sharded<hp::models::Transformer>(config); });
  model->checkpoint_layers.assign(o.layers, o.checkpoint);
  const int64_t full_params = numel_of(model->parameters());

  hp::FullyShardOptions options;
  options.mesh =
      o.replicate == 1
          ? hp::DeviceMesh(world, {{"dp_shard", o.shard}})
          : hp::DeviceMesh(world, {{"dp_replicate", o.replicate}, {"dp_shard", o.shard}});
  if (o.bf16) {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  options.comm_fusion = o.comm_fusion;
  for (auto& layer : model->layers) hp::fully_shard(layer, options);
  hp::fully_shard(model, options);
  if (!o.save_dir.empty()) check_writable("--save", o.save_dir, rank, all);
  if (!o.export_dir.empty()) check_writable("--export", o.export_dir, rank, all);
  std::string resume_from;  // empty: a fresh start
  if (o.resume == "auto") {
    resume_from = hp::latest_checkpoint(o.save_dir).value_or("");
    if (resume_from.empty() && rank == 0) {
      std::printf("no complete checkpoint under %s: starting fresh\n", o.save_dir.c_str());
    }
  } else {
    resume_from = o.resume;
  }
  if (resume_from.empty()) hp::materialize(*model);  // a resumed run loads its values below
  const int64_t local_params = numel_of(model->parameters());
  const std::string mesh_text = o.replicate == 1
                                    ? "dp_shard=" + std::to_string(o.shard) + " (FSDP)"
                                    : "dp_replicate=" + std::to_string(o.replicate) +
                                          " x dp_shard=" + std::to_string(o.shard) + " (HSDP)";

  if (rank == 0) {
    std::printf("train_decoder: copy task (2nd half of each sequence repeats the 1st)\n");
    std::printf("  ranks %lld, mesh %s\n", static_cast<long long>(ranks), mesh_text.c_str());
    std::printf("  model vocab %lld, dim %lld, heads %lld, layers %lld, ffn %lld, seq %lld\n",
                static_cast<long long>(o.vocab), static_cast<long long>(o.dim),
                static_cast<long long>(o.heads), static_cast<long long>(o.layers),
                static_cast<long long>(config.ffn_hidden), static_cast<long long>(o.seq));
    std::printf("  parameters %s full, %s on rank 0 (sharded)\n", with_commas(full_params).c_str(),
                with_commas(local_params).c_str());
    std::printf(
        "  %lld steps, global batch %lld (%lld per rank), AdamW lr %g, clip grad norm %g, "
        "mp %s, comm fusion %s, checkpoint %s, seed %lld\n\n",
        static_cast<long long>(o.steps), static_cast<long long>(o.batch),
        static_cast<long long>(o.batch / ranks), o.lr, o.clip_grad, o.bf16 ? "bf16" : "none",
        o.comm_fusion ? "on" : "off",
        !o.checkpoint                                     ? "none"
        : *o.checkpoint == hp::CheckpointImpl::kReentrant ? "reentrant"
                                                          : "non-reentrant",
        static_cast<long long>(o.seed));
    std::fflush(stdout);
  }

  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(o.lr));
  // Steps already taken: data batches continue where the checkpoint left off.
  int64_t done = 0;
  std::vector<double> losses, accuracies;
  // Resumed with the losses so far: the summary and its pass criterion are the
  // uninterrupted run's.
  bool whole_history = true;
  if (!resume_from.empty()) {
    if (hp::is_complete_checkpoint(resume_from)) {
      // Each rank reads only the pieces its shards need.
      const hp::StateDict state = hp::load_sharded_checkpoint(resume_from, *model, &optimizer);
      done = state["step"].item<int64_t>();
      losses = to_vector(state["losses"]);
      accuracies = to_vector(state["accuracies"]);
      restore_rng(state["rng_states"], rank);
    } else if (std::filesystem::exists(resume_from + "/model.pt")) {
      // An --export: both files stream, one tensor read at a time.
      hp::load_full_checkpoint(*model, resume_from + "/model.pt");
      hp::load_full_optimizer_checkpoint(*model, optimizer, resume_from + "/optim.pt");
      // AdamW counts steps per parameter; any parameter's count is the run's.
      auto state = optimizer.state().find(model->tok_embeddings->weight.unsafeGetTensorImpl());
      if (state != optimizer.state().end()) {
        done = static_cast<torch::optim::AdamWParamState&>(*state->second).step();
      }
      whole_history = false;
    } else {
      throw UsageError("--resume " + resume_from +
                       ": neither a complete sharded checkpoint (no COMPLETE marker) nor an "
                       "--export directory (no model.pt)");
    }
    if (rank == 0) {
      std::printf("resumed from %s after %lld steps\n\n", resume_from.c_str(),
                  static_cast<long long>(done));
    }
  }
  const auto save = [&](int64_t step) {
    const std::string dir = hp::checkpoint_dir_for_step(o.save_dir, step);
    hp::save_sharded_checkpoint(dir, *model, &optimizer,
                                run_state(step, losses, accuracies, all, ranks));
    if (rank == 0) std::printf("saved %s\n", dir.c_str());
  };
  const char* restart_count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = restart_count == nullptr || std::string_view(restart_count) == "0";
  const bool tty = isatty(STDOUT_FILENO) == 1;
  const int64_t print_every = tty ? 1 : std::max<int64_t>(1, o.steps / 20);
  const int64_t tokens_per_step = o.batch * (o.seq - 1);
  const auto start = Clock::now();
  auto last_report = start;
  int64_t last_report_step = done;

  for (int64_t step = done + 1; step <= o.steps; ++step) {
    if (step == o.fail_at_step && first_attempt && rank == ranks - 1) {
      throw std::runtime_error("--fail-at-step " + std::to_string(step) +
                               ": failing on purpose (fault injection)");
    }
    Batch batch = make_batch(o, step, rank, ranks);
    // Step 3: the implicit prefetch order is known and warm-up allocations are done.
    const bool traced = !o.trace_dir.empty() && step == done + 3;
    if (traced) hp::trace::start();
    optimizer.zero_grad();
    at::Tensor logits = predictable(model(batch.input), o.seq).to(at::kFloat);
    at::Tensor target = predictable(batch.target, o.seq);
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, o.vocab}), target.reshape(-1));
    loss.backward();
    // The norm of the whole gradients (shards combined across ranks), before clipping;
    // an infinite limit only measures it.
    const double grad_norm = hp::clip_grad_norm_(
        model->parameters(),
        o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity());
    optimizer.step();
    if (traced) write_trace(o.trace_dir, rank, hp::trace::stop());

    at::Tensor stats =
        torch::stack({loss.detach(), (logits.argmax(-1) == target).to(at::kFloat).mean()});
    hp::all_reduce(stats, hp::ReduceOp::kAvg, all).wait();
    at::Tensor rss = torch::full({1}, peak_rss_mib(), torch::kFloat);
    at::Tensor all_rss = torch::empty({ranks}, torch::kFloat);
    hp::all_gather(all_rss, rss, all).wait();
    losses.push_back(stats[0].item<double>());
    accuracies.push_back(stats[1].item<double>());
    if (o.save_every > 0 && step % o.save_every == 0 && step != o.steps) save(step);

    if (rank != 0 || (step % print_every != 0 && step != o.steps)) continue;
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last_report).count();
    const double tokens_per_s = (step - last_report_step) * tokens_per_step / seconds;
    last_report = now;
    last_report_step = step;
    const int64_t max_rank = all_rss.argmax().item<int64_t>();
    char line[256];
    std::snprintf(line, sizeof(line),
                  "step %5lld/%lld  loss %.4f  acc %5.1f%%  grad norm %6.3f  %7.0f tok/s  "
                  "peak RSS %.0f MiB (max, rank %lld)",
                  static_cast<long long>(step), static_cast<long long>(o.steps), losses.back(),
                  100 * accuracies.back(), grad_norm, tokens_per_s,
                  all_rss[max_rank].item<double>(), static_cast<long long>(max_rank));
    if (tty) {
      constexpr int kWidth = 24;
      const int filled = static_cast<int>(kWidth * step / o.steps);
      std::printf("\r[%s%s] %s", std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), line);
      if (step == o.steps) std::printf("\n");
    } else {
      std::printf("%s\n", line);
    }
    std::fflush(stdout);
  }

  if (!o.save_dir.empty()) save(o.steps);
  if (!o.export_dir.empty()) {
    // Every rank joins the gathers, one tensor at a time; rank 0 writes each and drops it.
    hp::save_full_checkpoint(*model, o.export_dir + "/model.pt");
    hp::save_full_optimizer_checkpoint(*model, optimizer, o.export_dir + "/optim.pt");
    // The others wait for rank 0's files: a rank that exits first could have the launcher
    // stop rank 0 mid-write.
    hp::barrier(all).wait();
    if (rank == 0) {
      std::printf("exported %s/model.pt and %s/optim.pt\n", o.export_dir.c_str(),
                  o.export_dir.c_str());
    }
  }
  if (losses.empty()) {
    if (rank == 0)
      std::printf("nothing to train: the run was at step %lld already\n",
                  static_cast<long long>(done));
    return 0;
  }

  // The last steps' mean: one step's loss on a fresh batch is noisy.
  const size_t tail = std::min<size_t>(10, losses.size());
  auto tail_mean = [&](const std::vector<double>& v) {
    double sum = 0;
    for (size_t i = v.size() - tail; i < v.size(); ++i) sum += v[i];
    return sum / tail;
  };
  const double first = losses.front(), final_loss = tail_mean(losses);
  const double final_acc = tail_mean(accuracies);
  // A resumed run may start converged already: it must not get worse.
  const bool learned = whole_history ? final_loss < 0.5 * first : final_loss <= first;
  if (rank == 0) {
    const double total = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf(
        "\nloss %.4f -> %.4f (mean of the last %zu steps), accuracy %.1f%% (chance "
        "%.1f%%), %lld steps in %.1f s\n",
        first, final_loss, tail, 100 * final_acc, 100.0 / o.vocab,
        static_cast<long long>(o.steps - done), total);
    if (!whole_history) {
      std::printf(learned ? "OK: the loss did not rise after resuming\n"
                          : "FAILED: the loss rose after resuming\n");
    } else if (learned) {
      std::printf("OK: the loss fell below half of its first value\n");
    } else {
      std::printf(
          "FAILED: the loss did not fall below half of its first value (%.4f); try "
          "more --steps or another --lr\n",
          0.5 * first);
    }
  }
  return learned ? 0 : 1;
}

// Before the world is joined: only rank 0 (or a plain single process) prints.
bool is_rank0() {
  const char* rank = std::getenv("RANK");
  return rank == nullptr || std::string_view(rank) == "0";
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);  // ranks share the machine's cores
  try {
    const Options options = parse_args(argc, argv);
    if (options.help) {
      if (is_rank0()) std::printf("%s", kUsage);
      return 0;
    }
    return train(options);
  } catch (const UsageError& error) {
    if (is_rank0()) {
      std::fprintf(stderr, "train_decoder: %s (see --help)\n", error.what());
    } else {
      // Every rank fails the same way; the launcher stops all ranks at the first exit,
      // so the others leave rank 0 the time to print the reason.
      std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "train_decoder: error: %s\n", error.what());
    return 1;
  }
}
