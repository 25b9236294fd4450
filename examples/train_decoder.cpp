// Trains a byte-level decoder-only transformer (models/transformer.h) with fully_shard
// (HSDP on a 2x2 mesh by default; with --tp, --cp, --ep and --experts also tensor,
// context and expert parallelism: examples/trainer/parallel_layout.h) on text files:
// training loss and throughput as it goes,
// validation loss and perplexity every so often, a generated sample at the end. Exits 0
// only if the final validation loss is below the corpus's unigram baseline.
//   hp-run -n 4 -- build/examples/train_decoder --data docs [options] (--help)
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "examples/trainer/loss_curve.h"
#include "examples/trainer/metrics_log.h"
#include "examples/trainer/parallel_layout.h"
#include "examples/trainer/text_batches.h"
#include "examples/trainer/text_corpus.h"
#include "examples/trainer/train_options.h"
#include "hyperparallel/clip_grad.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/context_parallel.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/launch_env.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "hyperparallel/tensor_parallel.h"
#include "hyperparallel/trace.h"
#include "models/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;
using hp::trainer::TrainOptions;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int64_t kVocab = 256;  // bytes

void write_trace(const std::string& dir, int64_t rank,
                 const std::vector<hp::trace::Event>& events) {
  std::filesystem::create_directories(dir);
  const std::string suffix = "_rank" + std::to_string(rank);
  std::ofstream(dir + "/trace" + suffix + ".json") << hp::trace::to_chrome_json(events, rank);
  std::ofstream(dir + "/timeline" + suffix + ".svg") << hp::trace::to_svg(
      events, "train_decoder, one training step, rank " + std::to_string(rank));
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
// steps taken (the data position) and every rank's random generator state.
hp::StateDict run_state(int64_t step, const hp::Group& all, int64_t ranks) {
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
  return state;
}

// This rank's generator state from a checkpoint; saved on another number of ranks, rank r
// takes row r modulo theirs.
void restore_rng(const at::Tensor& states, int64_t rank) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(states[rank % states.size(0)].clone());
}

// The loss of predicting every validation byte by the training bytes' frequencies (add-one
// smoothed), in nats: what a model that ignores context reaches. Each rank counts its
// share of both parts.
double unigram_baseline(const hp::trainer::TextCorpus& corpus, int64_t rank, int64_t ranks,
                        const hp::Group& all) {
  using hp::trainer::Split;
  at::Tensor counts = torch::zeros({2, kVocab}, torch::kDouble);
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const int64_t size = corpus.size(split);
    const int64_t begin = size * rank / ranks, end = size * (rank + 1) / ranks;
    const auto share = corpus.byte_counts(split, begin, end - begin);
    for (int64_t byte = 0; byte < kVocab; ++byte) {
      counts[split == Split::kTrain ? 0 : 1][byte] = static_cast<double>(share[byte]);
    }
  }
  hp::all_reduce(counts, hp::ReduceOp::kSum, all).wait();
  const at::Tensor probability = (counts[0] + 1) / (counts[0].sum() + kVocab);
  return -(counts[1] * probability.log()).sum().item<double>() / counts[1].sum().item<double>();
}

// The fp32 matmul rate one rank reaches while all ranks measure at once (they share the
// machine as they do while training), in FLOP/s; the mean over the ranks.
double measured_matmul_rate(const hp::Group& all) {
  // Its own generator: the default one's state is part of a checkpoint.
  at::Generator generator = at::detail::createCPUGenerator(1);
  const at::Tensor a = at::randn({256, 256}, generator), b = at::randn({256, 256}, generator);
  at::Tensor c = torch::mm(a, b);
  hp::barrier(all).wait();
  constexpr int kRepeats = 40;
  const auto start = Clock::now();
  for (int i = 0; i < kRepeats; ++i) c = torch::mm(a, b);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  at::Tensor rate = torch::full({1}, 2.0 * 256 * 256 * 256 * kRepeats / seconds, torch::kDouble);
  hp::all_reduce(rate, hp::ReduceOp::kAvg, all).wait();
  return rate.item<double>();
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

// Elements of `params` as this rank holds them, or (`whole`) of the whole tensors of
// parallel slices.
int64_t numel_of(const std::vector<at::Tensor>& params, bool whole = false) {
  int64_t n = 0;
  for (const auto& p : params) {
    const auto slice = whole ? hp::parallel_slice_of(p) : std::nullopt;
    n += p.numel() * (slice ? slice->group->size() : 1);
  }
  return n;
}

std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  char text[32];
  std::snprintf(text, sizeof text, s >= 60 ? "%lldm%02llds" : "%llds",
                static_cast<long long>(s >= 60 ? s / 60 : s), static_cast<long long>(s % 60));
  return text;
}

// Linear warmup to the peak, then cosine decay to a tenth of it at the last step.
double learning_rate(const TrainOptions& o, int64_t step) {
  if (step <= o.warmup) return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup);
  const double progress = static_cast<double>(step - o.warmup) /
                          static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  return o.lr * (0.1 + 0.45 * (1 + std::cos(M_PI * std::min(1.0, progress))));
}

// The mean next-byte loss of this rank's part of `batch`: its part of each sequence (cp)
// and its slice of the vocabulary (tp). Returns the loss and the bytes it averages.
template <typename Model>
std::pair<at::Tensor, int64_t> next_byte_loss(Model& model, const hp::trainer::Batch& batch,
                                              const hp::trainer::ParallelLayout& layout) {
  const c10::Device device = layout.mesh.world()->device();  // fully_shard's, too
  const at::Tensor data = hp::shard_sequence(batch.data.to(device), layout.context_parallel);
  const at::Tensor target = hp::shard_sequence(batch.target.to(device), layout.context_parallel);
  const at::Tensor logits = model(data);
  const at::Tensor loss =
      hp::vocab_parallel_cross_entropy(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                       target.reshape(-1), layout.tensor_parallel);
  return {loss, target.numel()};
}

// Mean loss per byte over every rank's validation batches.
template <typename Model>
double validation_loss(Model& model, const std::vector<hp::trainer::Batch>& batches,
                       const hp::trainer::ParallelLayout& layout, const hp::Group& all) {
  torch::NoGradGuard no_grad;
  at::Tensor sums = torch::zeros({2}, torch::kDouble);  // loss sum, bytes
  for (const auto& batch : batches) {
    const std::pair<at::Tensor, int64_t> loss = next_byte_loss(model, batch, layout);
    const int64_t bytes = loss.second;
    sums[0] += loss.first.item<double>() * static_cast<double>(bytes);
    sums[1] += static_cast<double>(bytes);
  }
  hp::all_reduce(sums, hp::ReduceOp::kSum, all).wait();
  return (sums[0] / sums[1]).item<double>();
}

// The whole logits [T, vocab] of one sequence `tokens` [1, T]: padded at its end to a
// length cp can split (causal: padding changes no earlier logit), its parts gathered back
// from the cp ranks, its vocabulary slices from the tp ranks.
template <typename Model>
at::Tensor whole_logits(Model& model, const at::Tensor& tokens,
                        const hp::trainer::ParallelLayout& layout) {
  const int64_t length = tokens.size(1), cp = layout.context_parallel->size();
  const int64_t padded = (length + 2 * cp - 1) / (2 * cp) * (2 * cp);
  const at::Tensor on_device = tokens.to(layout.mesh.world()->device());
  at::Tensor input = cp > 1 ? torch::constant_pad_nd(on_device, {0, padded - length}) : on_device;
  at::Tensor logits = model(hp::shard_sequence(input, layout.context_parallel));
  logits = hp::unshard_sequence(logits, layout.context_parallel);
  return hp::gather_from_tensor_parallel(logits, layout.tensor_parallel)[0].narrow(0, 0, length);
}

// `length` bytes after `prompt`, top-k sampled with a generator seeded alike on every
// rank: the ranks compute the same logits, so they draw the same bytes and run the same
// collectives.
template <typename Model>
std::string generate(Model& model, const std::string& prompt, int64_t length, int64_t context,
                     uint64_t seed, const hp::trainer::ParallelLayout& layout) {
  torch::NoGradGuard no_grad;
  at::Generator generator = at::detail::createCPUGenerator(seed);
  std::vector<int64_t> tokens;
  for (char c : prompt) tokens.push_back(static_cast<unsigned char>(c));
  if (tokens.empty()) tokens.push_back('\n');
  std::string text;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
    const at::Tensor input =
        torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end())).unsqueeze(0);
    const at::Tensor logits = whole_logits(model, input, layout)[-1].to(at::kCPU, at::kFloat) / 0.8;
    const auto [top, index] = logits.topk(8);
    const int64_t pick =
        torch::multinomial(torch::softmax(top, 0), 1, false, generator).item<int64_t>();
    const int64_t byte = index[pick].item<int64_t>();
    tokens.push_back(byte);
    text += static_cast<char>(byte);
  }
  return text;
}

// Text safe for a terminal: other control bytes and stray UTF-8 bytes shown as '?'.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? c : '?';
  return out;
}

int train(const TrainOptions& o, const std::string& resolved) {
  hp::WorldOptions world_options;
  if (o.timeout > 0) {
    world_options.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout * 1000)));
  }
  const hp::LaunchEnv launch = hp::LaunchEnv::from_environment();
  try {
    hp::trainer::check_world_size(o, launch.world_size);
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  std::shared_ptr<hp::World> world = hp::World::create(launch, world_options);
  const hp::Group& all = *world->world_group();
  const int64_t ranks = world->size(), rank = world->rank();
  std::optional<hp::trainer::ParallelLayout> parallel;
  try {
    parallel.emplace(hp::trainer::make_parallel_layout(world, o));
  } catch (const c10::ValueError& error) {  // the mesh refused the layout
    throw UsageError(error.what_without_backtrace());
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  const hp::trainer::ParallelLayout& layout = *parallel;
  const int64_t data_ranks = layout.data_ranks, data_rank = layout.data_rank;
  if (o.batch % data_ranks != 0) {
    throw UsageError("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                     std::to_string(data_ranks) + " data-parallel ranks");
  }
  const int64_t batch_per_rank = o.batch / data_ranks;
  std::shared_ptr<const hp::trainer::TextCorpus> corpus;
  std::optional<hp::trainer::TrainBatches> batches;
  std::vector<hp::trainer::Batch> validation;
  try {
    corpus = std::make_shared<hp::trainer::TextCorpus>(o.data, o.validation_fraction);
    batches.emplace(corpus, o.seq, batch_per_rank, data_rank, data_ranks,
                    static_cast<uint64_t>(o.seed));
    validation = hp::trainer::validation_batches(corpus, o.seq, batch_per_rank, o.eval_batches,
                                                 data_rank, data_ranks);
  } catch (const std::invalid_argument& error) {
    throw UsageError(std::string("--data: ") + error.what());
  }
  const double unigram = unigram_baseline(*corpus, rank, ranks, all);

  hp::models::TransformerConfig config;
  config.vocab = kVocab;
  config.dim = o.dim;
  config.heads = o.heads;
  config.layers = o.layers;
  config.ffn_hidden = 4 * o.dim;
  config.max_seq = o.seq;
  config.tensor_parallel = layout.tensor_parallel;
  config.context_parallel = layout.context_parallel;
  if (o.experts > 0) {
    for (int64_t i = 1; i < o.layers; i += 2) config.moe.layers.push_back(i);
    config.moe.num_experts = o.experts;
    config.moe.top_k = o.top_k;
    config.moe.expert_hidden = 2 * o.dim;
    config.moe.load_balance_coef = o.balance_loss;
    config.expert_parallel = layout.expert_parallel;
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  torch::manual_seed(static_cast<uint64_t>(o.seed));  // the same initial model on every rank
  // Recorded, not allocated: no rank ever holds the whole model; each materializes (or
  // loads) only its shards, below.
  auto model = hp::deferred_init([&] { return hp::Sharded<hp::models::Transformer>(config); });
  model->recompute_layers.assign(o.layers, o.recompute_impl());
  const int64_t full_params = numel_of(model->parameters(), /*whole=*/true);
  // A token runs through top_k of each MoE layer's experts: only theirs count as its FLOPs.
  double active_params = static_cast<double>(full_params);
  for (auto& layer : model->layers) {
    if (!layer->moe) continue;
    const auto& moe = layer->moe->options;
    active_params -= static_cast<double>(numel_of(layer->moe->experts->parameters(), true)) *
                     (1.0 - static_cast<double>(moe.top_k) / static_cast<double>(moe.num_experts));
  }

  hp::FullyShardOptions options;
  options.mesh = layout.dense_mesh;
  if (o.mp == "bf16") {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  options.comm_fusion = o.comm_fusion;
  hp::FullyShardOptions experts_options = options;
  experts_options.mesh = layout.experts_mesh;
  for (auto& layer : model->layers) {
    if (layer->moe) {  // before its block: over the ranks orthogonal to ep
      hp::fully_shard(layer->moe->experts, experts_options)
          .set_gradient_divide_factor(layout.experts_divide_factor);
    }
    hp::fully_shard(layer, options);
  }
  hp::fully_shard(model, options);
  if (!o.save.empty()) check_writable("--save", o.save, rank, all);
  if (!o.export_dir.empty()) check_writable("--export", o.export_dir, rank, all);
  if (!o.out.empty()) check_writable("--out", o.out, rank, all);
  std::string resume_from;  // empty: a fresh start
  if (o.resume == "auto") {
    std::vector<std::string> damaged;
    resume_from = hp::latest_checkpoint(o.save, &damaged).value_or("");
    for (const std::string& why : damaged) {
      if (rank == 0)
        std::printf("--resume auto: passing over a damaged checkpoint: %s\n", why.c_str());
    }
    if (resume_from.empty() && rank == 0) {
      std::printf("no complete checkpoint under %s: starting fresh\n", o.save.c_str());
    }
  } else {
    resume_from = o.resume;
  }
  if (resume_from.empty()) hp::materialize(*model);  // a resumed run loads its values below
  const int64_t local_params = numel_of(model->parameters());

  if (rank == 0) {
    std::printf(
        "train_decoder: byte-level language model on %zu text files (%s training bytes, "
        "%s validation bytes); unigram baseline %.4f nats per byte\n",
        corpus->files().size(), with_commas(corpus->size(hp::trainer::Split::kTrain)).c_str(),
        with_commas(corpus->size(hp::trainer::Split::kValidation)).c_str(), unigram);
    std::printf("  ranks %lld, parameters %s full, %s on rank 0 (sharded)\n",
                static_cast<long long>(ranks), with_commas(full_params).c_str(),
                with_commas(local_params).c_str());
    std::printf("resolved configuration (usable as --config):\n%s\n", resolved.c_str());
    std::fflush(stdout);
  }

  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(o.lr));
  int64_t done = 0;  // steps already taken: the data continue where the checkpoint left off
  if (!resume_from.empty()) {
    if (hp::is_complete_checkpoint(resume_from)) {
      // Each rank reads only the pieces its shards need.
      const hp::StateDict state = hp::load_sharded_checkpoint(resume_from, *model, &optimizer);
      done = state["step"].item<int64_t>();
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
  std::vector<hp::trainer::MetricsRecord> records;
  std::optional<hp::trainer::MetricsLog> metrics;
  if (!o.out.empty() && rank == 0) {
    // A resumed run keeps what was logged up to its checkpoint.
    records = hp::trainer::read_metrics(o.out + "/metrics.jsonl", done);
    metrics.emplace(o.out + "/metrics.jsonl", records);
  }
  const auto save = [&](int64_t step) {
    const std::string dir = hp::checkpoint_dir_for_step(o.save, step);
    hp::save_sharded_checkpoint(dir, *model, &optimizer, run_state(step, all, ranks));
    if (rank == 0) std::printf("saved %s\n", dir.c_str());
  };
  // This attempt's fault, if any: the step before which a rank fails, and that rank.
  const char* restart_count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const size_t attempt = restart_count == nullptr ? 0 : std::stoul(restart_count);
  const int64_t fail_at_step = attempt < o.fail_at_steps.size() ? o.fail_at_steps[attempt] : 0;
  const int64_t fail_rank =
      o.fail_ranks.empty() || attempt >= o.fail_ranks.size() ? ranks - 1 : o.fail_ranks[attempt];
  if (fail_at_step > 0 && fail_rank >= ranks) {
    throw std::invalid_argument("--fail-rank " + std::to_string(fail_rank) + ": there are only " +
                                std::to_string(ranks) + " ranks");
  }
  const double matmul_rate = measured_matmul_rate(all);

  const bool tty = isatty(STDOUT_FILENO) == 1;
  const int64_t log_every = o.log_every > 0 ? o.log_every : std::max<int64_t>(1, o.steps / 20);
  const int64_t eval_every = o.eval_every > 0 ? o.eval_every : std::max<int64_t>(1, o.steps / 5);
  const int64_t tokens_per_step = o.batch * o.seq;
  const auto start = Clock::now();
  auto last_report = start;
  int64_t last_report_step = done;
  double final_validation = std::numeric_limits<double>::quiet_NaN();
  double tokens_per_s = 0;

  for (int64_t step = done + 1; step <= o.steps; ++step) {
    if (step == fail_at_step && rank == fail_rank) {
      std::printf("--fail-at-step %lld: rank %lld fails on purpose (fault injection)\n",
                  static_cast<long long>(step), static_cast<long long>(rank));
      std::fflush(stdout);
      if (o.fail_by_kill) raise(SIGKILL);
      throw std::runtime_error("--fail-at-step " + std::to_string(step) +
                               ": failing on purpose (fault injection)");
    }
    const hp::trainer::Batch batch = batches->at_step(step);
    // The third step: the implicit prefetch order is known and warm-up allocations are done.
    const bool traced = !o.trace.empty() && step == done + 3;
    if (traced) hp::trace::start(world->device());
    for (auto& group : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(o, step));
    }
    optimizer.zero_grad();
    const at::Tensor loss = next_byte_loss(model, batch, layout).first;
    (o.experts > 0 ? loss + model->aux_loss() : loss).backward();
    // The norm of the whole gradients (shards combined across ranks), before clipping;
    // an infinite limit only measures it.
    const double grad_norm = hp::clip_grad_norm_(
        model->parameters(),
        o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity());
    optimizer.step();
    if (traced) write_trace(o.trace, rank, hp::trace::stop());

    at::Tensor mean_loss = loss.detach().clone();
    hp::all_reduce(mean_loss, hp::ReduceOp::kAvg, all).wait();
    if (o.save_every > 0 && step % o.save_every == 0 && step != o.steps) save(step);
    const bool log = step % log_every == 0 || step == o.steps;
    const bool evaluate = step % eval_every == 0 || step == o.steps;
    if (!log && !evaluate) continue;

    hp::trainer::MetricsRecord record;
    record.step = step;
    record.loss = mean_loss.item<double>();
    record.grad_norm = grad_norm;
    const auto now = Clock::now();
    tokens_per_s = static_cast<double>((step - last_report_step) * tokens_per_step) /
                   std::chrono::duration<double>(now - last_report).count();
    record.tokens_per_s = tokens_per_s;
    record.elapsed_s = std::chrono::duration<double>(now - start).count();
    if (evaluate)
      record.validation_loss = final_validation = validation_loss(model, validation, layout, all);
    last_report = Clock::now();  // evaluation time does not count against throughput
    last_report_step = step;
    if (rank != 0) continue;
    records.push_back(record);
    if (metrics) metrics->append(record);
    const double eta =
        record.elapsed_s / static_cast<double>(step - done) * static_cast<double>(o.steps - step);
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %6lld/%lld  loss %.4f  grad norm %6.3f  %7.0f tok/s  ETA %s",
                  static_cast<long long>(step), static_cast<long long>(o.steps), record.loss,
                  grad_norm, tokens_per_s, duration_text(eta).c_str());
    if (tty) {
      constexpr int kWidth = 20;
      const int filled = static_cast<int>(kWidth * step / o.steps);
      std::printf("\r[%s%s] %s\033[K", std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), line);
    } else {
      std::printf("%s\n", line);
    }
    if (record.validation_loss) {
      std::printf("%svalidation loss %.4f  perplexity %.2f  (unigram baseline %.4f)\n",
                  tty ? "\n" : "", *record.validation_loss, std::exp(*record.validation_loss),
                  unigram);
    }
    std::fflush(stdout);
  }
  if (tty && rank == 0) std::printf("\n");

  if (!o.save.empty()) save(o.steps);
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
  if (std::isnan(final_validation)) {
    final_validation = validation_loss(model, validation, layout, all);
  }
  const std::string sample = o.sample_bytes > 0 ? generate(model, o.prompt, o.sample_bytes, o.seq,
                                                           static_cast<uint64_t>(o.seed), layout)
                                                : "";
  at::Tensor rss = torch::full({1}, peak_rss_mib(), torch::kFloat);
  at::Tensor all_rss = torch::empty({ranks}, torch::kFloat);
  hp::all_gather(all_rss, rss, all).wait();

  const bool learned = final_validation < unigram;
  if (rank == 0) {
    if (!o.out.empty()) {
      const std::string svg = hp::trainer::loss_curve_svg(
          records,
          "train_decoder: " + with_commas(full_params) + " parameters, " + std::to_string(ranks) +
              " ranks (" + o.mesh + ")",
          unigram);
      std::ofstream(o.out + "/loss.svg.partial") << svg;
      std::filesystem::rename(o.out + "/loss.svg.partial", o.out + "/loss.svg");
      std::printf("wrote %s/metrics.jsonl and %s/loss.svg\n", o.out.c_str(), o.out.c_str());
    }
    if (!sample.empty()) {
      std::printf("\nsample:\n%s%s\n\n", printable(o.prompt).c_str(), printable(sample).c_str());
    }
    // PaLM's estimate: 6 FLOPs per active parameter and token, plus attention's score and
    // value products.
    const double flops_per_token =
        6.0 * active_params + 12.0 * static_cast<double>(o.layers * o.dim * o.seq);
    const double achieved = tokens_per_s * flops_per_token;
    std::printf("peak RSS per rank (MiB):");
    for (int64_t r = 0; r < ranks; ++r) std::printf(" %.0f", all_rss[r].item<double>());
    std::printf(
        "\nmodel FLOPs utilisation %.1f%% (%.2f GFLOP/s of %lld ranks x %.2f GFLOP/s "
        "measured fp32 matmul)\n",
        100 * achieved / (static_cast<double>(ranks) * matmul_rate), achieved / 1e9,
        static_cast<long long>(ranks), matmul_rate / 1e9);
    std::printf("%s: validation loss %.4f (perplexity %.2f) %s the unigram baseline %.4f\n",
                learned ? "OK" : "FAILED", final_validation, std::exp(final_validation),
                learned ? "below" : "not below", unigram);
    std::fflush(stdout);
  }
  // Every rank exits with the verdict, after rank 0 printed it: a launcher stops the
  // others at the first nonzero exit.
  hp::barrier(all).wait();
  world->shutdown();  // the process groups end here, not in static destructors
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
  const hp::trainer::ParsedOptions parsed =
      hp::trainer::parse_train_options(argc, argv, is_rank0());
  try {
    if (parsed.exit_code) {
      if (*parsed.exit_code != 0 && !is_rank0())
        std::this_thread::sleep_for(std::chrono::seconds(2));
      return *parsed.exit_code;
    }
    return train(parsed.options, parsed.resolved);
  } catch (const UsageError& error) {
    if (is_rank0()) {
      std::fprintf(stderr, "train_decoder: %s (see --help)\n", error.what());
    } else {
      // Every rank fails the same way; the launcher stops all ranks at the first exit,
      // so the others leave rank 0 the time to print the reason.
      std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    return 2;
  } catch (const c10::Error& error) {
    // One line, not LibTorch's C++ backtrace (e.g. a collective's timeout).
    std::fprintf(stderr, "train_decoder: error: %s\n", error.what_without_backtrace());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "train_decoder: error: %s\n", error.what());
    return 1;
  }
}
