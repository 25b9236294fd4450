// Trains a byte-level decoder-only transformer (models/transformer.h) with fully_shard
// (HSDP on a 2x2 mesh by default; with --tp, --cp, --ep and --experts also tensor,
// context and expert parallelism: examples/trainer/parallel_layout.h; with --pp, pipeline
// stages: examples/trainer/pipeline_stages.h) on text files:
// training loss and throughput as it goes,
// validation loss and perplexity every so often, a generated sample at the end. Exits 0
// when the run finished (with --require-learning, only if the final validation loss is
// below the corpus's unigram baseline), 1 on an error. SIGTERM or
// SIGINT (a preemption) stops every rank after the same step, with a last-words checkpoint
// when --save is given, and exits with 128 + the signal (examples/trainer/preemption.h).
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
#include <functional>
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
#include "examples/trainer/pipeline_stages.h"
#include "examples/trainer/preemption.h"
#include "examples/trainer/text_batches.h"
#include "examples/trainer/text_corpus.h"
#include "examples/trainer/train_options.h"
#include "hyperparallel/async_checkpoint.h"
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
  const at::Tensor loss =
      hp::trainer::next_byte_cross_entropy(model(data), target, layout.tensor_parallel);
  return {loss, target.numel()};
}

// A batch's mean loss and the bytes it averages; {undefined, 0} on a rank that computes
// none (a pipeline rank without the last stage).
using LossOf = std::function<std::pair<at::Tensor, int64_t>(const hp::trainer::Batch&)>;

// Mean loss per byte over every rank's validation batches.
double validation_loss(const LossOf& loss_of, const std::vector<hp::trainer::Batch>& batches,
                       const hp::Group& all) {
  torch::NoGradGuard no_grad;
  at::Tensor sums = torch::zeros({2}, torch::kDouble);  // loss sum, bytes
  for (const auto& batch : batches) {
    const std::pair<at::Tensor, int64_t> loss = loss_of(batch);
    if (loss.second == 0) continue;
    const int64_t bytes = loss.second;
    sums[0] += loss.first.item<double>() * static_cast<double>(bytes);
    sums[1] += static_cast<double>(bytes);
  }
  hp::all_reduce(sums, hp::ReduceOp::kSum, all).wait();
  return (sums[0] / sums[1]).item<double>();
}

// The whole logits [T, vocab] of one sequence `tokens` [1, T] by `forward` (this rank's
// logits of this rank's tokens): padded at its end to a length cp can split (causal:
// padding changes no earlier logit), its parts gathered back from the cp ranks, its
// vocabulary slices from the tp ranks. Undefined where `forward` gives none (a pipeline
// rank without the last stage, as are its cp and tp peers).
template <typename Forward>
at::Tensor whole_logits(Forward&& forward, const at::Tensor& tokens,
                        const hp::trainer::ParallelLayout& layout) {
  const int64_t length = tokens.size(1), cp = layout.context_parallel->size();
  const int64_t padded = (length + 2 * cp - 1) / (2 * cp) * (2 * cp);
  const at::Tensor on_device = tokens.to(layout.mesh.world()->device());
  at::Tensor input = cp > 1 ? torch::constant_pad_nd(on_device, {0, padded - length}) : on_device;
  at::Tensor logits = forward(hp::shard_sequence(input, layout.context_parallel));
  if (!logits.defined()) return logits;
  logits = hp::unshard_sequence(logits, layout.context_parallel);
  return hp::gather_from_tensor_parallel(logits, layout.tensor_parallel)[0].narrow(0, 0, length);
}

// The logits [vocab] of the byte after `tokens` [1, T], the same on every rank.
using NextLogits = std::function<at::Tensor(const at::Tensor&)>;

// `length` bytes after `prompt`, top-k sampled with a generator seeded alike on every
// rank: the ranks compute the same logits, so they draw the same bytes and run the same
// collectives.
std::string generate(const NextLogits& next_logits, const std::string& prompt, int64_t length,
                     int64_t context, uint64_t seed) {
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
    const at::Tensor logits = next_logits(input).to(at::kCPU, at::kFloat) / 0.8;
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

// ---- The job: ranks, their layout, the data ------------------------------------------

struct Job {
  std::shared_ptr<hp::World> world;
  hp::trainer::ParallelLayout layout;
  int64_t rank = 0, ranks = 1;
  const hp::Group& all() const { return *world->world_group(); }
};

// Joins the world and divides its ranks as the options ask. A layout the ranks cannot
// make is a usage error, found before any connection where the launch environment shows it.
Job join_job(const TrainOptions& o) {
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
  try {
    hp::trainer::ParallelLayout layout = hp::trainer::make_parallel_layout(world, o);
    return Job{world, std::move(layout), world->rank(), world->size()};
  } catch (const c10::ValueError& error) {  // the mesh refused the layout
    throw UsageError(error.what_without_backtrace());
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
}

struct TextData {
  std::shared_ptr<const hp::trainer::TextCorpus> corpus;
  std::optional<hp::trainer::TrainBatches> batches;  // this rank's share of each step
  std::vector<hp::trainer::Batch> validation;        // this rank's share
  double unigram = 0;                                // the loss a model has to beat
};

TextData load_data(const TrainOptions& o, const Job& job) {
  const int64_t data_ranks = job.layout.data_ranks, data_rank = job.layout.data_rank;
  if (o.batch % data_ranks != 0) {
    throw UsageError("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                     std::to_string(data_ranks) + " data-parallel ranks");
  }
  const int64_t batch_per_rank = o.batch / data_ranks;
  TextData data;
  try {
    data.corpus = std::make_shared<hp::trainer::TextCorpus>(o.data, o.validation_fraction);
    data.batches.emplace(data.corpus, o.seq, batch_per_rank, data_rank, data_ranks,
                         static_cast<uint64_t>(o.seed));
    data.validation = hp::trainer::validation_batches(data.corpus, o.seq, batch_per_rank,
                                                      o.eval_batches, data_rank, data_ranks);
  } catch (const std::invalid_argument& error) {
    throw UsageError(std::string("--data: ") + error.what());
  }
  data.unigram = unigram_baseline(*data.corpus, job.rank, job.ranks, job.all());
  return data;
}

// ---- The model -------------------------------------------------------------------------

using Decoder = hp::Sharded<hp::models::Transformer>;

hp::models::TransformerConfig decoder_config(const TrainOptions& o,
                                             const hp::trainer::ParallelLayout& layout) {
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
  return config;
}

// Recorded, not allocated: no rank ever holds the whole model; each materializes (or
// loads) only its shards once it is sharded.
Decoder deferred_decoder(const TrainOptions& o, const hp::trainer::ParallelLayout& layout) {
  const hp::models::TransformerConfig config = decoder_config(o, layout);
  torch::manual_seed(static_cast<uint64_t>(o.seed));  // the same initial model on every rank
  Decoder model = hp::deferred_init([&] { return Decoder(config); });
  model->recompute_layers.assign(o.layers, o.recompute_options());
  return model;
}

struct ModelSize {
  int64_t params = 0;        // whole tensors, every parallel slice counted
  double active_params = 0;  // what one token runs through: top_k of each MoE layer's experts
};

ModelSize size_of(Decoder& model) {
  ModelSize size;
  size.params = numel_of(model->parameters(), /*whole=*/true);
  size.active_params = static_cast<double>(size.params);
  for (auto& layer : model->layers) {
    if (!layer->moe) continue;
    const auto& moe = layer->moe->options;
    size.active_params -=
        static_cast<double>(numel_of(layer->moe->experts->parameters(), true)) *
        (1.0 - static_cast<double>(moe.top_k) / static_cast<double>(moe.num_experts));
  }
  return size;
}

hp::FullyShardOptions shard_options(const TrainOptions& o,
                                    const hp::trainer::ParallelLayout& layout) {
  hp::FullyShardOptions options;
  options.mesh = layout.dense_mesh;
  if (o.mp == "bf16") {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  options.comm_fusion = o.comm_fusion;
  options.comm_fusion_bucket_bytes = o.comm_fusion_bucket_bytes;
  options.comm_policy.all_gather_codec = hp::parse_comm_codec(o.ag_codec);
  options.comm_policy.reduce_scatter_codec = hp::parse_comm_codec(o.rs_codec);
  options.comm_policy.block_size = o.codec_block;
  options.comm_policy.error_feedback = o.error_feedback;
  return options;
}

// Each block, each MoE layer's experts (before their block, over the ranks orthogonal to
// ep) and the root.
void shard(Decoder& model, const TrainOptions& o, const hp::trainer::ParallelLayout& layout) {
  const hp::FullyShardOptions options = shard_options(o, layout);
  for (auto& layer : model->layers) hp::trainer::shard_block(layer, options, layout);
  hp::fully_shard(model, options);
}

// ---- Checkpoints -----------------------------------------------------------------------

// The checkpoint to resume from: --resume's, or (auto) the newest complete one under
// --save; empty for a fresh start.
std::string checkpoint_to_resume(const TrainOptions& o, int64_t rank) {
  if (o.resume != "auto") return o.resume;
  std::vector<std::string> damaged;
  const std::string latest = hp::latest_checkpoint(o.save, &damaged, o.resume_crc).value_or("");
  if (rank == 0) {
    for (const std::string& why : damaged) {
      std::printf("--resume auto: passing over a damaged checkpoint: %s\n", why.c_str());
    }
    if (latest.empty())
      std::printf("no complete checkpoint under %s: starting fresh\n", o.save.c_str());
  }
  return latest;
}

// Loads a sharded checkpoint or an --export into the model (under --pp: this rank's
// stages), the optimizer and the run's random generators; returns the steps already taken
// (the data continue from there).
int64_t resume(const std::string& from, torch::nn::Module& model, torch::optim::AdamW& optimizer,
               int64_t rank, bool pipelined) {
  int64_t done = 0;
  if (hp::is_complete_checkpoint(from)) {
    // Each rank reads only the pieces its shards need.
    const hp::StateDict state = hp::load_sharded_checkpoint(from, model, &optimizer);
    done = state["step"].item<int64_t>();
    restore_rng(state["rng_states"], rank);
    if (const at::Tensor* signal = state.find("last_words"); signal != nullptr && rank == 0) {
      std::printf("%s is the last-words checkpoint of a run stopped by %s\n", from.c_str(),
                  hp::trainer::signal_name(signal->item<int>()).c_str());
    }
  } else if (std::filesystem::exists(from + "/model.pt")) {
    if (pipelined) {
      throw UsageError("--resume " + from +
                       ": an --export loads into the whole model, not into pipeline stages; "
                       "resume it without --pp and --save a sharded checkpoint for --pp");
    }
    // An --export: both files stream, one tensor read at a time.
    hp::load_full_checkpoint(model, from + "/model.pt");
    hp::load_full_optimizer_checkpoint(model, optimizer, from + "/optim.pt");
    // AdamW counts steps per parameter; any parameter's count is the run's.
    auto state = optimizer.state().find(model.parameters().front().unsafeGetTensorImpl());
    if (state != optimizer.state().end()) {
      done = static_cast<torch::optim::AdamWParamState&>(*state->second).step();
    }
  } else {
    throw UsageError("--resume " + from +
                     ": neither a complete sharded checkpoint (no COMPLETE marker) nor an "
                     "--export directory (no model.pt)");
  }
  if (rank == 0) {
    std::printf("resumed from %s after %lld steps\n\n", from.c_str(), static_cast<long long>(done));
  }
  return done;
}

// Checkpoints never hold inf or NaN weights: every rank checks its part, and all agree.
void require_finite_weights(torch::nn::Module& model, int64_t step, const Job& job) {
  at::Tensor non_finite = torch::zeros({}, torch::kLong);
  for (const auto& param : model.parameters()) {
    non_finite += param.detach().isfinite().logical_not().sum().cpu();
  }
  non_finite = non_finite.to(torch::kFloat).reshape({1});
  hp::all_reduce(non_finite, hp::ReduceOp::kSum, job.all()).wait();
  if (non_finite.item<double>() != 0) {
    C10_THROW_ERROR(Error, "after step " + std::to_string(step) + " the weights hold " +
                               std::to_string(static_cast<int64_t>(non_finite.item<double>())) +
                               " inf or NaN values: not saved (the latest checkpoint stays "
                               "the one to resume from); lower --lr or check the data");
  }
}

// The checkpoint after `step`: in the background with `saver` (null: before returning).
// `last_words`: the signal that preempted the run, kept in the checkpoint as "last_words"
// (0: a regular save; a resumed run treats both alike).
void save(const TrainOptions& o, int64_t step, torch::nn::Module& model,
          torch::optim::AdamW& optimizer, const Job& job, hp::AsyncCheckpointSaver* saver = nullptr,
          int last_words = 0) {
  require_finite_weights(model, step, job);
  const std::string dir = hp::checkpoint_dir_for_step(o.save, step);
  hp::StateDict state = run_state(step, job.all(), job.ranks);
  if (last_words != 0) state.insert("last_words", at::scalar_tensor(last_words, at::kLong));
  if (saver) {
    saver->save(dir, model, &optimizer, state);
    if (job.rank == 0) std::printf("saving %s in the background\n", dir.c_str());
    return;
  }
  hp::save_sharded_checkpoint(dir, model, &optimizer, state);
  if (job.rank != 0) return;
  if (last_words == 0) {
    std::printf("saved %s\n", dir.c_str());
  } else {
    std::printf("preempted: last-words checkpoint at step %lld in %s\n",
                static_cast<long long>(step), dir.c_str());
  }
}

// --export: rank 0 writes whole tensors into DIR/model.pt and DIR/optim.pt, one at a time.
// Every rank joins the gathers; under --pp, where no rank holds the whole model, the
// stages' sharded checkpoint (the final --save, else one kept in DIR meanwhile) is what
// rank 0 converts.
void export_full(const TrainOptions& o, torch::nn::Module& model, torch::optim::AdamW& optimizer,
                 const Job& job, bool pipelined) {
  require_finite_weights(model, o.steps, job);
  const std::string& dir = o.export_dir;
  if (!pipelined) {
    hp::save_full_checkpoint(model, dir + "/model.pt");
    hp::save_full_optimizer_checkpoint(model, optimizer, dir + "/optim.pt");
  } else {
    const std::string sharded =
        o.save.empty() ? dir + "/.stages" : hp::checkpoint_dir_for_step(o.save, o.steps);
    if (o.save.empty()) hp::save_sharded_checkpoint(sharded, model, &optimizer);
    if (job.rank == 0) {
      hp::convert_to_full_checkpoint(sharded, dir + "/model.pt", dir + "/optim.pt");
      if (o.save.empty()) std::filesystem::remove_all(sharded);
    }
  }
  // The others wait for rank 0's files: a rank that exits first could have the launcher
  // stop rank 0 mid-write.
  hp::barrier(job.all()).wait();
  if (job.rank == 0)
    std::printf("exported %s/model.pt and %s/optim.pt\n", dir.c_str(), dir.c_str());
}

// ---- Fault injection (--fail-at-step) --------------------------------------------------

struct InjectedFault {
  int64_t before_step = 0;  // 0: none in this attempt
  int64_t rank = 0;
};

// This attempt's fault (the attempt: TORCHELASTIC_RESTART_COUNT).
InjectedFault fault_of_this_attempt(const TrainOptions& o, int64_t ranks) {
  const char* restart_count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const size_t attempt = restart_count == nullptr ? 0 : std::stoul(restart_count);
  InjectedFault fault;
  fault.before_step = attempt < o.fail_at_steps.size() ? o.fail_at_steps[attempt] : 0;
  fault.rank =
      o.fail_ranks.empty() || attempt >= o.fail_ranks.size() ? ranks - 1 : o.fail_ranks[attempt];
  if (fault.before_step > 0 && fault.rank >= ranks) {
    throw UsageError("--fail-rank " + std::to_string(fault.rank) + ": there are only " +
                     std::to_string(ranks) + " ranks");
  }
  return fault;
}

void fail_if_due(const InjectedFault& fault, int64_t step, int64_t rank, bool by_kill) {
  if (step != fault.before_step || rank != fault.rank) return;
  std::printf("--fail-at-step %lld: rank %lld fails on purpose (fault injection)\n",
              static_cast<long long>(step), static_cast<long long>(rank));
  std::fflush(stdout);
  if (by_kill) raise(SIGKILL);
  throw std::runtime_error("--fail-at-step " + std::to_string(step) +
                           ": failing on purpose (fault injection)");
}

// ---- One training step -----------------------------------------------------------------

// A step's gradients, clipped, before the optimizer's update.
struct StepResult {
  at::Tensor loss;          // this rank's
  at::Tensor balance_loss;  // the MoE layers' balancing loss, this rank's stages' (or none)
  double grad_norm = 0;     // of the whole gradients, before clipping
};

void set_learning_rate(torch::optim::AdamW& optimizer, const TrainOptions& o, int64_t step) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(o, step));
  }
}

StepResult step_gradients(Decoder& model, torch::optim::AdamW& optimizer,
                          const hp::trainer::Batch& batch, const TrainOptions& o,
                          const hp::trainer::ParallelLayout& layout) {
  optimizer.zero_grad();
  StepResult result;
  result.loss = next_byte_loss(model, batch, layout).first;
  if (o.balances_experts()) result.balance_loss = model->aux_loss().detach();
  (o.balances_experts() ? result.loss + model->aux_loss() : result.loss).backward();
  // Shards combined across ranks; an infinite limit only measures the norm.
  result.grad_norm = hp::clip_grad_norm_(
      model->parameters(), o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity());
  return result;
}

// The same through the pipeline's schedule (--pp).
StepResult pipeline_step_gradients(hp::trainer::DecoderPipeline& pipeline,
                                   torch::optim::AdamW& optimizer, const hp::trainer::Batch& batch,
                                   const TrainOptions& o) {
  optimizer.zero_grad();
  StepResult result;
  const hp::trainer::DecoderPipeline::Losses losses = pipeline.forward_backward(batch);
  result.loss = losses.loss;
  result.balance_loss = losses.balance_loss;
  result.grad_norm = pipeline.clip_grad_norm(
      o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity());
  return result;
}

// Steps with a non-finite loss or gradient norm on any rank make no update, on every rank;
// --max-skipped-steps of them in a row stop the run.
class SkippedSteps {
 public:
  SkippedSteps(const TrainOptions& o, int64_t rank) : limit_(o.max_skipped_steps), rank_(rank) {}

  // The step's mean loss over the ranks, and whether its update is to be made: one
  // all-reduce of the loss and of whether the norm was finite, so every rank decides alike.
  std::pair<double, bool> decide(const StepResult& result, int64_t step, const Job& job) {
    at::Tensor values =
        torch::stack({result.loss.detach().to(torch::kCPU, torch::kFloat),
                      torch::scalar_tensor(std::isfinite(result.grad_norm) ? 0 : 1)});
    hp::all_reduce(values, hp::ReduceOp::kAvg, job.all()).wait();
    const double loss = values[0].item<double>();
    if (std::isfinite(loss) && values[1].item<double>() == 0) {
      in_a_row_ = 0;
      return {loss, true};
    }
    ++in_a_row_;
    ++total_;
    if (rank_ == 0) {
      std::fprintf(stderr,
                   "train_decoder: step %lld skipped (no update): loss %g, gradient norm %g, "
                   "not finite on some rank; %lld in a row, %lld in all\n",
                   static_cast<long long>(step), loss, result.grad_norm,
                   static_cast<long long>(in_a_row_), static_cast<long long>(total_));
    }
    if (in_a_row_ >= limit_) {
      C10_THROW_ERROR(Error, "--max-skipped-steps " + std::to_string(limit_) + ": steps " +
                                 std::to_string(step - in_a_row_ + 1) + " to " +
                                 std::to_string(step) +
                                 " all had a non-finite loss or gradient norm; lower --lr "
                                 "(or raise --warmup), or check the data");
    }
    return {loss, false};
  }

 private:
  int64_t limit_, rank_, in_a_row_ = 0, total_ = 0;
};

// How the run evaluates and samples its model: whole on every rank, or through the
// pipeline's stages forward only (the last stage's results sent to the others).
struct Evaluation {
  LossOf loss_of;
  NextLogits next_logits;
};

Evaluation evaluation_of(Decoder& model, const hp::trainer::ParallelLayout& layout) {
  return {.loss_of =
              [&model, &layout](const hp::trainer::Batch& batch) {
                return next_byte_loss(model, batch, layout);
              },
          .next_logits =
              [&model, &layout](const at::Tensor& tokens) {
                return whole_logits(model, tokens, layout)[-1];
              }};
}

Evaluation evaluation_of(hp::trainer::DecoderPipeline& pipeline,
                         const hp::trainer::ParallelLayout& layout) {
  return {
      .loss_of =
          [&pipeline, &layout](const hp::trainer::Batch& batch) {
            const at::Tensor logits =
                pipeline.logits(hp::shard_sequence(batch.data, layout.context_parallel));
            if (!logits.defined()) return std::pair<at::Tensor, int64_t>{at::Tensor(), 0};
            const at::Tensor target =
                hp::shard_sequence(batch.target.to(logits.device()), layout.context_parallel);
            return std::pair<at::Tensor, int64_t>{
                hp::trainer::next_byte_cross_entropy(logits, target, layout.tensor_parallel),
                target.numel()};
          },
      .next_logits =
          [&pipeline, &layout](const at::Tensor& tokens) {
            const at::Tensor logits = whole_logits(
                [&pipeline](const at::Tensor& x) { return pipeline.logits(x); }, tokens, layout);
            at::Tensor next = logits.defined() ? logits[-1].to(at::kCPU, at::kFloat).contiguous()
                                               : torch::empty({kVocab}, torch::kFloat);
            hp::broadcast(next, layout.pipeline->size() - 1, *layout.pipeline).wait();
            return next;
          }};
}

// ---- Progress: the log lines, metrics.jsonl, throughput --------------------------------

class Progress {
 public:
  Progress(const TrainOptions& o, const Job& job, int64_t done, double unigram)
      : o_(o),
        rank_(job.rank),
        done_(done),
        unigram_(unigram),
        tty_(isatty(STDOUT_FILENO) == 1),
        log_every_(o.log_every > 0 ? o.log_every : std::max<int64_t>(1, o.steps / 20)),
        eval_every_(o.eval_every > 0 ? o.eval_every : std::max<int64_t>(1, o.steps / 5)),
        last_report_step_(done) {
    if (!o.out.empty() && rank_ == 0) {
      // A resumed run keeps what was logged up to its checkpoint.
      records_ = hp::trainer::read_metrics(o.out + "/metrics.jsonl", done);
      metrics_.emplace(o.out + "/metrics.jsonl", records_);
    }
  }

  bool logs(int64_t step) const { return step % log_every_ == 0 || step == o_.steps; }
  bool evaluates(int64_t step) const { return step % eval_every_ == 0 || step == o_.steps; }

  // The step's record with the throughput since the last report.
  hp::trainer::MetricsRecord measure(int64_t step, double loss, double grad_norm) {
    const auto now = Clock::now();
    hp::trainer::MetricsRecord record;
    record.step = step;
    record.loss = loss;
    record.grad_norm = grad_norm;
    tokens_per_s_ = static_cast<double>((step - last_report_step_) * o_.batch * o_.seq) /
                    std::chrono::duration<double>(now - last_report_).count();
    record.tokens_per_s = tokens_per_s_;
    record.elapsed_s = std::chrono::duration<double>(now - start_).count();
    return record;
  }

  // Rank 0 prints and logs `record`. The clock restarts: evaluation does not count against
  // throughput.
  void report(const hp::trainer::MetricsRecord& record) {
    last_report_ = Clock::now();
    last_report_step_ = record.step;
    if (rank_ != 0) return;
    records_.push_back(record);
    if (metrics_) metrics_->append(record);
    const double eta = record.elapsed_s / static_cast<double>(record.step - done_) *
                       static_cast<double>(o_.steps - record.step);
    char balance[32] = "";
    if (record.balance_loss) {
      std::snprintf(balance, sizeof balance, "  balance %.4f", *record.balance_loss);
    }
    char line[256];
    std::snprintf(
        line, sizeof line, "step %6lld/%lld  loss %.4f%s  grad norm %6.3f  %7.0f tok/s  ETA %s",
        static_cast<long long>(record.step), static_cast<long long>(o_.steps), record.loss, balance,
        record.grad_norm, record.tokens_per_s, duration_text(eta).c_str());
    if (tty_) {
      constexpr int kWidth = 20;
      const int filled = static_cast<int>(kWidth * record.step / o_.steps);
      std::printf("\r[%s%s] %s\033[K", std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), line);
    } else {
      std::printf("%s\n", line);
    }
    if (record.validation_loss) {
      std::printf("%svalidation loss %.4f  perplexity %.2f  (unigram baseline %.4f)\n",
                  tty_ ? "\n" : "", *record.validation_loss, std::exp(*record.validation_loss),
                  unigram_);
    }
    std::fflush(stdout);
  }

  // Ends the progress bar's line.
  void finish() const {
    if (tty_ && rank_ == 0) std::printf("\n");
  }

  const std::vector<hp::trainer::MetricsRecord>& records() const { return records_; }
  double tokens_per_s() const { return tokens_per_s_; }

 private:
  const TrainOptions& o_;
  int64_t rank_, done_;
  double unigram_;
  bool tty_;
  int64_t log_every_, eval_every_;
  Clock::time_point start_ = Clock::now(), last_report_ = start_;
  int64_t last_report_step_;
  double tokens_per_s_ = 0;
  std::vector<hp::trainer::MetricsRecord> records_;  // rank 0's, with --out
  std::optional<hp::trainer::MetricsLog> metrics_;
};

// ---- The start and the end of a run ----------------------------------------------------

void print_header(const TrainOptions& o, const Job& job, const TextData& data,
                  const ModelSize& size, int64_t local_params, const std::string& resolved) {
  if (job.rank != 0) return;
  const hp::trainer::TextCorpus& corpus = *data.corpus;
  std::printf(
      "train_decoder: byte-level language model on %zu text files (%s training bytes, "
      "%s validation bytes); unigram baseline %.4f nats per byte\n",
      corpus.files().size(), with_commas(corpus.size(hp::trainer::Split::kTrain)).c_str(),
      with_commas(corpus.size(hp::trainer::Split::kValidation)).c_str(), data.unigram);
  std::printf("  ranks %lld, parameters %s full, %s on rank 0 (sharded)\n",
              static_cast<long long>(job.ranks), with_commas(size.params).c_str(),
              with_commas(local_params).c_str());
  if (o.pp > 1) {
    std::printf("  pipeline: %lld stages over %lld ranks, schedule %s, %lld microbatches\n",
                static_cast<long long>(o.pp * o.virtual_stages), static_cast<long long>(o.pp),
                o.pp_schedule.c_str(), static_cast<long long>(o.microbatches));
  }
  std::printf("resolved configuration (usable as --config):\n%s\n", resolved.c_str());
  std::fflush(stdout);
}

// What rank 0 prints at the end; `learned`: the verdict.
struct Summary {
  double validation_loss = 0;
  bool learned = false;
  std::string sample;
  at::Tensor peak_rss_mib;  // [ranks]
  double matmul_rate = 0;   // FLOP/s, measured before training
};

void print_summary(const TrainOptions& o, const Job& job, const TextData& data,
                   const ModelSize& size, const Progress& progress, const Summary& summary) {
  if (job.rank != 0) return;
  if (!o.out.empty()) {
    const std::string svg =
        hp::trainer::loss_curve_svg(progress.records(),
                                    "train_decoder: " + with_commas(size.params) + " parameters, " +
                                        std::to_string(job.ranks) + " ranks (" + o.mesh + ")",
                                    data.unigram);
    std::ofstream(o.out + "/loss.svg.partial") << svg;
    std::filesystem::rename(o.out + "/loss.svg.partial", o.out + "/loss.svg");
    std::printf("wrote %s/metrics.jsonl and %s/loss.svg\n", o.out.c_str(), o.out.c_str());
  }
  if (!summary.sample.empty()) {
    std::printf("\nsample:\n%s%s\n\n", printable(o.prompt).c_str(),
                printable(summary.sample).c_str());
  }
  // PaLM's estimate: 6 FLOPs per active parameter and token, plus attention's score and
  // value products.
  const double flops_per_token =
      6.0 * size.active_params + 12.0 * static_cast<double>(o.layers * o.dim * o.seq);
  const double achieved = progress.tokens_per_s() * flops_per_token;
  std::printf("peak RSS per rank (MiB):");
  for (int64_t r = 0; r < job.ranks; ++r) {
    std::printf(" %.0f", summary.peak_rss_mib[r].item<double>());
  }
  std::printf(
      "\nmodel FLOPs utilisation %.1f%% (%.2f GFLOP/s of %lld ranks x %.2f GFLOP/s "
      "measured fp32 matmul)\n",
      100 * achieved / (static_cast<double>(job.ranks) * summary.matmul_rate), achieved / 1e9,
      static_cast<long long>(job.ranks), summary.matmul_rate / 1e9);
  const char* verdict = !o.require_learning ? "" : summary.learned ? "OK: " : "FAILED: ";
  std::printf("%svalidation loss %.4f (perplexity %.2f) %s the unigram baseline %.4f\n", verdict,
              summary.validation_loss, std::exp(summary.validation_loss),
              summary.learned ? "below" : "not below", data.unigram);
  std::fflush(stdout);
}

// ---- The run ---------------------------------------------------------------------------

// The two copies of the tied embedding (stage 0's and the last stage's) are the same, bit
// for bit, on every data-parallel position; a failure if not.
void check_tied_copies(hp::trainer::DecoderPipeline& pipeline, int64_t rank) {
  if (!pipeline.tied_copies_equal()) {
    throw std::runtime_error(
        "the tied embedding's copies on the first and last pipeline stages differ");
  }
  if (rank == 0) {
    std::printf("tied embedding: the first and last stages' copies are bitwise equal\n");
  }
}

// The end of a run preempted after `step` (its last-words checkpoint, if any, written): 128 +
// the signal, as a shell, Kubernetes or Slurm report a process the signal ended, so that a
// restart policy sees "terminated, not done" and `--resume auto` continues.
int stop_preempted(const TrainOptions& o, int signal, int64_t step, const Job& job,
                   const Progress& progress) {
  progress.finish();
  const int status = 128 + signal;
  if (job.rank == 0) {
    std::printf("preempted by %s: stopped after step %lld%s; exit status %d\n",
                hp::trainer::signal_name(signal).c_str(), static_cast<long long>(step),
                o.save.empty() ? " without a checkpoint (no --save)" : "", status);
    std::fflush(stdout);
  }
  // Rank 0 prints before any rank exits: a launcher stops the others at the first exit.
  hp::barrier(job.all()).wait();
  job.world->shutdown();
  return status;
}

int train(const TrainOptions& o, const std::string& resolved) {
  const Job job = join_job(o);
  const hp::trainer::ParallelLayout& layout = job.layout;
  TextData data = load_data(o, job);

  Decoder model = deferred_decoder(o, layout);
  const ModelSize size = size_of(model);
  std::optional<hp::trainer::DecoderPipeline> pipeline;  // --pp: this rank's stages
  if (o.pp > 1) {
    pipeline.emplace(model, o, layout, shard_options(o, layout));
  } else {
    shard(model, o, layout);
  }
  if (!o.save.empty()) check_writable("--save", o.save, job.rank, job.all());
  if (!o.export_dir.empty()) check_writable("--export", o.export_dir, job.rank, job.all());
  if (!o.out.empty()) check_writable("--out", o.out, job.rank, job.all());
  const std::string resume_from = checkpoint_to_resume(o, job.rank);
  // A resumed run loads its values; the pipeline materialized its stages.
  if (resume_from.empty() && !pipeline) hp::materialize(*model);
  const std::vector<at::Tensor> parameters =
      pipeline ? pipeline->parameters() : model->parameters();
  print_header(o, job, data, size, numel_of(parameters), resolved);
  const Evaluation evaluation =
      pipeline ? evaluation_of(*pipeline, layout) : evaluation_of(model, layout);

  // What the checkpoints hold (under --pp, this rank's stages by the whole decoder's names).
  torch::nn::Module& saved = pipeline ? pipeline->saved_part() : *model;
  torch::nn::Module& loaded = pipeline ? pipeline->loaded_part() : *model;
  torch::optim::AdamW optimizer(parameters, torch::optim::AdamWOptions(o.lr));
  const int64_t done = resume_from.empty()
                           ? 0
                           : resume(resume_from, loaded, optimizer, job.rank, pipeline.has_value());
  const InjectedFault fault = fault_of_this_attempt(o, job.ranks);
  Summary summary;
  summary.matmul_rate = measured_matmul_rate(job.all());
  Progress progress(o, job, done, data.unigram);  // its clock starts here
  std::optional<double> validation;               // the latest
  // From here on SIGTERM and SIGINT stop the run after a step (before, they end it at
  // once: there is nothing to save yet).
  const hp::trainer::PreemptionWatch preemption(
      std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.grace_period * 1000))));
  std::optional<hp::AsyncCheckpointSaver> saver;
  if (o.async_save) saver.emplace();
  SkippedSteps skipped_steps(o, job.rank);

  for (int64_t step = done + 1; step <= o.steps; ++step) {
    fail_if_due(fault, step, job.rank, o.fail_by_kill);
    // The third step: the implicit prefetch order is known and warm-up allocations are done.
    const bool traced = !o.trace.empty() && step == done + 3;
    if (traced) hp::trace::start(job.world->device());
    const hp::trainer::Batch batch = data.batches->at_step(step);
    set_learning_rate(optimizer, o, step);
    const StepResult result = pipeline ? pipeline_step_gradients(*pipeline, optimizer, batch, o)
                                       : step_gradients(model, optimizer, batch, o, layout);
    const auto [mean_loss, updates] = skipped_steps.decide(result, step, job);
    if (updates) {
      optimizer.step();
    } else {
      optimizer.zero_grad();
    }
    if (traced) write_trace(o.trace, job.rank, hp::trace::stop());

    // A signal on any rank stops every rank after this same step: the checkpoint first
    // (after the one in the background, if any), while the grace period lasts.
    const int preempted_by = preemption.agreed_signal(job.all());
    if (preempted_by != 0 && !o.save.empty()) {
      if (saver) saver->wait();
      save(o, step, saved, optimizer, job, nullptr, preempted_by);
    } else if (preempted_by == 0 && o.save_every > 0 && step % o.save_every == 0 &&
               step != o.steps) {
      save(o, step, saved, optimizer, job, saver ? &*saver : nullptr);
    }
    if (progress.logs(step) || progress.evaluates(step)) {
      hp::trainer::MetricsRecord record = progress.measure(step, mean_loss, result.grad_norm);
      record.skipped = !updates;
      if (o.balances_experts()) {
        at::Tensor mean = result.balance_loss.to(at::kFloat).cpu().clone();
        hp::all_reduce(mean, hp::ReduceOp::kAvg, job.all()).wait();
        record.balance_loss = mean.item<double>();
      }
      if (progress.evaluates(step)) {
        record.validation_loss = validation =
            validation_loss(evaluation.loss_of, data.validation, job.all());
      }
      progress.report(record);
    }
    if (preempted_by != 0) return stop_preempted(o, preempted_by, step, job, progress);
  }
  progress.finish();

  if (saver) saver->wait();
  if (!o.save.empty()) save(o, o.steps, saved, optimizer, job);
  if (!o.export_dir.empty()) export_full(o, saved, optimizer, job, pipeline.has_value());
  summary.validation_loss =
      validation ? *validation : validation_loss(evaluation.loss_of, data.validation, job.all());
  summary.learned = summary.validation_loss < data.unigram;
  if (o.sample_bytes > 0) {
    summary.sample = generate(evaluation.next_logits, o.prompt, o.sample_bytes, o.seq,
                              static_cast<uint64_t>(o.seed));
  }
  if (pipeline) check_tied_copies(*pipeline, job.rank);
  summary.peak_rss_mib = torch::empty({job.ranks}, torch::kFloat);
  hp::all_gather(summary.peak_rss_mib, torch::full({1}, peak_rss_mib(), torch::kFloat), job.all())
      .wait();
  print_summary(o, job, data, size, progress, summary);
  // Every rank exits with the same status, after rank 0 printed the summary: a launcher
  // stops the others at the first nonzero exit.
  hp::barrier(job.all()).wait();
  job.world->shutdown();  // the process groups end here, not in static destructors
  return summary.learned || !o.require_learning ? 0 : 1;
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
