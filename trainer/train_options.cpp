#include "trainer/train_options.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "trainer/toml_config.h"

namespace hp::trainer {

std::optional<RecomputeOptions> TrainOptions::recompute_options() const {
  if (recompute == "reentrant") return RecomputeOptions{.impl = RecomputeImpl::kReentrant};
  if (recompute == "non-reentrant") return RecomputeOptions{.impl = RecomputeImpl::kNonReentrant};
  return std::nullopt;
}

namespace {

// "RxS" with R, S >= 1; the error text is CLI11's convention (empty: valid).
std::string check_mesh(const std::string& text) {
  const size_t x = text.find('x');
  int64_t r = 0, s = 0;
  const auto number = [](std::string_view part, int64_t& value) {
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    return ec == std::errc() && end == part.data() + part.size() && value >= 1;
  };
  if (x == std::string::npos || !number(std::string_view(text).substr(0, x), r) ||
      !number(std::string_view(text).substr(x + 1), s)) {
    return "needs RxS (replicas x shards, e.g. 2x2 or 1x4), got '" + text + "'";
  }
  return "";
}

// NaN and infinity pass every range check (each comparison with NaN is false).
const CLI::Validator kFinite(
    [](std::string& text) -> std::string {
      char* end = nullptr;
      const double value = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || !std::isfinite(value)) {
        return "must be a finite number, got '" + text + "'";
      }
      return "";
    },
    "FINITE");

// In place of CLI11's PositiveNumber and NonNegativeNumber: ranges up to the largest double,
// whose messages print all 309 digits of it.
double number_of(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  return end == text.c_str() ? std::nan("") : value;
}
const CLI::Validator kPositive(
    [](std::string& text) -> std::string {
      return number_of(text) > 0 ? "" : "must be positive, got '" + text + "'";
    },
    "POSITIVE");
const CLI::Validator kNonNegative(
    [](std::string& text) -> std::string {
      return number_of(text) >= 0 ? "" : "must not be negative, got '" + text + "'";
    },
    "NONNEGATIVE");

// The text and its split.
void add_data_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--data", o.data, "text files and directories (searched recursively)")
      ->required()
      ->group("Data");
  app.add_option("--val-fraction", o.validation_fraction,
                 "the end of every file held out for validation")
      ->check(kFinite)
      ->check(CLI::Range(0.01, 0.5))
      ->group("Data");
}

// The decoder's shape.
void add_model_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--seq", o.seq, "sequence length in bytes")
      ->check(CLI::Range(2, 1 << 16))
      ->group("Model");
  app.add_option("--dim", o.dim, "model width")->check(CLI::Range(1, 1 << 16))->group("Model");
  app.add_option("--layers", o.layers, "decoder blocks")
      ->check(CLI::Range(1, 1024))
      ->group("Model");
  app.add_option("--heads", o.heads, "attention heads, must divide --dim")
      ->check(CLI::Range(1, 1 << 16))
      ->group("Model");
}

// The optimizer, its schedule and the batch.
void add_training_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--steps", o.steps, "optimizer steps in all (a resumed run ends there too)")
      ->check(CLI::Range(1, 10'000'000))
      ->group("Training");
  app.add_option("--batch", o.batch, "global batch in sequences, divisible by the ranks")
      ->check(CLI::Range(1, 1 << 20))
      ->group("Training");
  app.add_option("--lr", o.lr, "AdamW peak learning rate")
      ->check(kFinite)
      ->check(kPositive)
      ->group("Training");
  app.add_option("--optimizer-implementation", o.optimizer_implementation,
                 "fused: AdamW steps every shard of a device and dtype in one kernel; "
                 "for-loop: torch::optim::AdamW's kernels per parameter (checkpoints are the "
                 "same either way)")
      ->check(CLI::IsMember({"fused", "for-loop"}))
      ->group("Training");
  app.add_option("--warmup", o.warmup, "linear warmup steps, then cosine decay to lr/10")
      ->check(CLI::Range(0, 10'000'000))
      ->group("Training");
  app.add_option("--clip-grad", o.clip_grad, "clip gradients to this global norm; 0: off")
      ->check(kFinite)
      ->check(kNonNegative)
      ->group("Training");
  app.add_option("--max-skipped-steps", o.max_skipped_steps,
                 "a step with a non-finite loss or gradient norm is skipped (no update); "
                 "this many in a row stop the run with an error")
      ->check(CLI::Range(1, 1'000'000))
      ->group("Training");
  app.add_option("--seed", o.seed, "initialization, data order and sampling")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->group("Training");
}

// How the ranks divide the work.
void add_layout_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--mesh", o.mesh,
                 "R replicas x S shards: the data-parallel ranks (R x S x cp x tp = number of "
                 "ranks); R=1: plain FSDP")
      ->check(check_mesh, "RxS")
      ->group("Parallelism");
  app.add_option("--tp", o.tp, "tensor-parallel ranks: heads, FFN and vocabulary split over them")
      ->check(kPositive)
      ->group("Parallelism");
  app.add_option("--cp", o.cp,
                 "context-parallel ranks: each sequence split over them (load-balanced "
                 "chunks; --seq divisible by 2 x cp)")
      ->check(kPositive)
      ->group("Parallelism");
  app.add_option("--ep", o.ep,
                 "expert-parallel ranks, taken from the S shards: the experts split over them")
      ->check(kPositive)
      ->group("Parallelism");
  app.add_option("--pp", o.pp,
                 "pipeline-parallel ranks (outermost: pp x R x S ranks): the decoder's layers "
                 "split into stages over them, each stage fully_shard-ed over its R x S ranks")
      ->check(kPositive)
      ->group("Parallelism");
  app.add_option("--pp-schedule", o.pp_schedule,
                 "pipeline schedule under --pp: gpipe, 1f1b, interleaved (--virtual-stages >= 2); "
                 "zero-bubble is refused (see docs/trainer.md)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zero-bubble"}))
      ->group("Parallelism");
  app.add_option("--microbatches", o.microbatches,
                 "microbatches per step under --pp; must divide the batch per data-parallel "
                 "rank (interleaved: a multiple of --pp)")
      ->check(kPositive)
      ->group("Parallelism");
  app.add_option("--virtual-stages", o.virtual_stages,
                 "model chunks per pipeline rank (interleaved: >= 2; else 1); --layers must "
                 "divide into pp x virtual-stages stages")
      ->check(kPositive)
      ->group("Parallelism");
}

// The mixture-of-experts layers (the "Model" group too).
void add_moe_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--experts", o.experts,
                 "experts per MoE layer; > 0: every odd layer's FFN is a mixture of experts")
      ->check(kNonNegative)
      ->group("Model");
  app.add_option("--top-k", o.top_k, "experts per token in the MoE layers")
      ->check(kPositive)
      ->group("Model");
  app.add_option("--balance-loss", o.balance_loss,
                 "coefficient of the MoE layers' load-balancing loss (0: none)")
      ->check(kFinite)
      ->check(kNonNegative)
      ->group("Model");
}

// Precision, communication, recomputation and timeouts.
void add_runtime_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--mp", o.mp,
                 "bf16: parameters gathered and used in bf16, gradients reduced in fp32")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->group("Parallelism");
  app.add_flag("--comm-fusion", o.comm_fusion,
               "one all-gather / reduce-scatter per module instead of per parameter")
      ->group("Parallelism");
  app.add_option("--comm-fusion-bucket", o.comm_fusion_bucket_bytes,
                 "with --comm-fusion: a module's buffer moves in collectives of whole "
                 "parameters of at most this many bytes on the wire per peer, all issued at "
                 "once (e.g. 128KiB, which keeps a slow TCP link full; 0: one per module)")
      ->transform(CLI::AsSizeValue(/*kb_is_1000=*/false))
      ->check(kNonNegative)
      ->group("Parallelism");
  app.add_option("--ag-codec", o.ag_codec,
                 "parameter all-gathers send int8 or fp8 blocks (one byte per value plus an "
                 "fp32 scale per --codec-block values); the optimizer still steps fp32 shards")
      ->check(CLI::IsMember({"none", "int8", "fp8"}))
      ->group("Parallelism");
  app.add_option("--rs-codec", o.rs_codec,
                 "gradient reduce-scatters send int8 or fp8 blocks, summed in fp32 on arrival")
      ->check(CLI::IsMember({"none", "int8", "fp8"}))
      ->group("Parallelism");
  app.add_option("--codec-block", o.codec_block, "values per quantization scale")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->group("Parallelism");
  app.add_flag("--error-feedback", o.error_feedback,
               "keep what --rs-codec's codes did not carry and send it with the next step's "
               "gradient (fp32, the unsharded gradient's size per rank; kept in checkpoints)")
      ->group("Parallelism");
  app.add_option("--timeout", o.timeout,
                 "seconds start-up and every collective wait for the other ranks before failing "
                 "(naming the ranks that did not arrive); 0: HP_TIMEOUT_S from the environment, "
                 "else 300")
      ->check(kFinite)
      ->check(CLI::Range(0.0, 1e7))
      ->group("Parallelism");
  app.add_option("--recompute", o.recompute, "activation recomputation of every block")
      ->check(CLI::IsMember({"none", "reentrant", "non-reentrant"}))
      ->group("Parallelism");
}

// Progress, validation, metrics, traces and the sample.
void add_output_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--log-every", o.log_every, "steps between progress lines; 0: about 20 per run")
      ->check(kNonNegative)
      ->group("Output");
  app.add_option("--eval-every", o.eval_every, "steps between validations; 0: about 5 per run")
      ->check(kNonNegative)
      ->group("Output");
  app.add_option("--eval-batches", o.eval_batches, "validation batches per rank")
      ->check(CLI::Range(1, 1 << 20))
      ->group("Output");
  app.add_option("--prompt", o.prompt, "start of the sample generated at the end")->group("Output");
  app.add_option("--sample-bytes", o.sample_bytes, "length of that sample; 0: none")
      ->check(CLI::Range(0, 1 << 16))
      ->group("Output");
  app.add_option("--out", o.out,
                 "write metrics.jsonl (one record per logged step) and loss.svg here")
      ->group("Output");
  app.add_flag("--require-learning", o.require_learning,
               "exit 1 unless the final validation loss is below the unigram baseline "
               "(printed either way)")
      ->group("Output");
  app.add_option("--trace", o.trace,
                 "record the third step of every rank as DIR/trace_rank<R>.json (Chrome trace) "
                 "and DIR/timeline_rank<R>.svg")
      ->group("Output");
}

// Saving, resuming, exporting, and fault injection for restart tests.
void add_checkpoint_options(CLI::App& app, TrainOptions& o) {
  app.add_option("--save", o.save,
                 "write sharded checkpoints (model, optimizer, step, RNG) as DIR/step-<N>, every "
                 "rank its own shards: at the end and every --save-every steps")
      ->group("Checkpoints");
  app.add_option("--save-every", o.save_every,
                 "also save after every N-th step; 0: only at the end")
      ->check(kNonNegative)
      ->group("Checkpoints");
  app.add_flag("--async-save", o.async_save,
               "write the --save-every checkpoints in the background while training goes on "
               "(hp::AsyncCheckpointSaver: a step is blocked only for the snapshot); the final "
               "and last-words checkpoints are written before the run ends")
      ->group("Checkpoints");
  app.add_option("--resume", o.resume,
                 "auto: continue from the newest complete checkpoint under --save (a fresh start "
                 "when there is none); PATH: from that sharded checkpoint (on any --mesh, with or "
                 "without --pp) or --export directory (on any --mesh, without --pp)")
      ->group("Checkpoints");
  app.add_flag("--resume-crc", o.resume_crc,
               "with --resume auto: read the whole candidate checkpoint and check every "
               "piece's CRC-32 before choosing it (without: its files' headers and sizes)")
      ->group("Checkpoints");
  app.add_option("--grace-period", o.grace_period,
                 "on SIGTERM or SIGINT (a preemption) the ranks finish their step, save a "
                 "last-words checkpoint with --save and exit with 128 + the signal (143 for "
                 "SIGTERM); this many seconds after the signal they exit at once, saved or "
                 "not (keep it below the launcher's: hp-run --grace-period, 30 s)")
      ->check(kFinite)
      ->check(CLI::Range(0.001, 1e7))
      ->group("Checkpoints");
  app.add_option("--export", o.export_dir,
                 "at the end, write DIR/model.pt and DIR/optim.pt (whole tensors, for Python's "
                 "torch.load; under --pp converted from the stages' sharded checkpoint)")
      ->group("Checkpoints");
  app.add_option("--fail-at-step", o.fail_at_steps,
                 "fault injection for restart tests: a rank fails before step N; given k times, "
                 "the i-th applies to attempt i (TORCHELASTIC_RESTART_COUNT=i, unset: 0)")
      ->check(kPositive)
      ->group("Checkpoints");
  app.add_option("--fail-rank", o.fail_ranks,
                 "the rank that fails at each --fail-at-step (default: the last rank)")
      ->check(kNonNegative)
      ->group("Checkpoints");
  app.add_flag("--fail-by-kill", o.fail_by_kill,
               "the failing rank dies by SIGKILL (no message, no cleanup) instead of throwing")
      ->group("Checkpoints");
}

// What --pp does not compose with, and the pipeline's own shape rules; empty when none.
std::string pipeline_contradiction(const TrainOptions& o) {
  const bool interleaved = o.pp_schedule == "interleaved";
  if (o.pp_schedule == "zero-bubble") {
    return "--pp-schedule zero-bubble is not available: LibTorch's autograd cannot split a "
           "backward into input and weight halves without running the graph twice (the two "
           "halves take about 1.5x the whole backward, bench/pipeline_bench.cpp --split-backward), "
           "about as much as the bubble it removes; use 1f1b or interleaved";
  }
  if (interleaved && o.virtual_stages < 2) {
    return "--pp-schedule interleaved needs --virtual-stages >= 2 (model chunks per pipeline "
           "rank), got " +
           std::to_string(o.virtual_stages);
  }
  if (!interleaved && o.virtual_stages != 1) {
    return "--virtual-stages " + std::to_string(o.virtual_stages) +
           " needs --pp-schedule interleaved (" + o.pp_schedule + " runs one stage per rank)";
  }
  if (o.pp == 1) {
    // Without a pipeline the pipeline flags mean nothing; their defaults (as a resolved
    // configuration repeats them) are fine, another value is a mistake.
    const TrainOptions defaults;
    if (o.pp_schedule != defaults.pp_schedule || o.microbatches != defaults.microbatches) {
      return "--pp-schedule and --microbatches set how a pipeline runs; they need --pp >= 2";
    }
    return "";
  }
  const int64_t stages = o.pp * o.virtual_stages;
  if (o.layers % stages != 0) {
    return "--layers (" + std::to_string(o.layers) + ") must be divisible into --pp x " +
           "--virtual-stages = " + std::to_string(stages) + " stages of equal layers";
  }
  if (interleaved && o.microbatches % o.pp != 0) {
    return "--pp-schedule interleaved needs --microbatches (" + std::to_string(o.microbatches) +
           ") to be a multiple of --pp (" + std::to_string(o.pp) + ")";
  }
  const int64_t data_ranks = o.replicate * o.shard;
  if (o.batch % data_ranks == 0 && (o.batch / data_ranks) % o.microbatches != 0) {
    return "--microbatches (" + std::to_string(o.microbatches) +
           ") must divide the batch per data-parallel rank (--batch " + std::to_string(o.batch) +
           " / " + std::to_string(data_ranks) + " = " + std::to_string(o.batch / data_ranks) + ")";
  }
  if (o.error_feedback && (!o.save.empty() || !o.resume.empty())) {
    return "--pp with --error-feedback does not compose with --save or --resume yet: the last "
           "stage's copy of the tied embedding keeps residuals of its own, which the whole "
           "decoder's checkpoint has no entry for; drop --error-feedback or the checkpoints";
  }
  return "";
}

// The first contradiction among options each valid alone; empty when there is none.
std::string contradiction(const TrainOptions& o, const CLI::App& app) {
  if (o.dim % o.heads != 0) {
    return "--heads (" + std::to_string(o.heads) + ") must divide --dim (" + std::to_string(o.dim) +
           ")";
  }
  if (o.shard % o.ep != 0) {
    return "--ep (" + std::to_string(o.ep) + ") must divide the shards of --mesh (" +
           std::to_string(o.shard) + "): the expert-parallel ranks are taken from them";
  }
  if (o.ep > 1 && o.experts == 0) {
    return "--ep " + std::to_string(o.ep) + " needs MoE layers: give --experts";
  }
  if (o.experts == 0 && (app.count("--top-k") > 0 || app.count("--balance-loss") > 0)) {
    return std::string(app.count("--top-k") > 0 ? "--top-k" : "--balance-loss") +
           " applies to MoE layers, and there are none: give --experts";
  }
  if (o.experts > 0 && o.experts % o.ep != 0) {
    return "--experts (" + std::to_string(o.experts) + ") must be divisible by --ep (" +
           std::to_string(o.ep) + "): each expert-parallel rank holds experts / ep";
  }
  if (o.experts > 0 && o.top_k > o.experts) {
    return "--top-k (" + std::to_string(o.top_k) + ") exceeds --experts (" +
           std::to_string(o.experts) + ")";
  }
  if (o.cp > 1 && o.seq % (2 * o.cp) != 0) {
    return "--seq (" + std::to_string(o.seq) + ") must be divisible by 2 x --cp (" +
           std::to_string(2 * o.cp) + "): each rank holds two of 2 x cp equal chunks";
  }
  if (o.heads % o.tp != 0) {
    return "--tp (" + std::to_string(o.tp) + ") must divide --heads (" + std::to_string(o.heads) +
           ")";
  }
  if (o.comm_fusion_bucket_bytes != 0 && !o.comm_fusion) {
    return "--comm-fusion-bucket sizes the collectives of --comm-fusion: give --comm-fusion";
  }
  const bool quantized = o.ag_codec != "none" || o.rs_codec != "none";
  if (quantized && o.shard == 1) {
    return std::string(o.ag_codec != "none" ? "--ag-codec" : "--rs-codec") +
           " quantizes the collectives among the shards of --mesh, and there is one shard: "
           "nothing would be quantized";
  }
  if (!quantized && app.count("--codec-block") > 0) {
    return "--codec-block applies to quantized collectives: give --ag-codec or --rs-codec";
  }
  if (o.error_feedback && o.rs_codec == "none") {
    return "--error-feedback carries the quantized reduce-scatter's residual: give --rs-codec";
  }
  if (o.resume == "auto" && o.save.empty()) {
    return "--resume auto needs --save DIR (the checkpoints it looks for)";
  }
  if (o.resume_crc && o.resume != "auto") {
    return "--resume-crc checks the checkpoints --resume auto chooses from: give --resume auto";
  }
  if (o.save_every > 0 && o.save.empty()) {
    return "--save-every needs --save DIR";
  }
  if (o.async_save && o.save_every == 0) {
    return "--async-save writes the --save-every checkpoints in the background; give "
           "--save DIR --save-every N";
  }
  if (const std::string message = pipeline_contradiction(o); !message.empty()) return message;
  if (!o.fail_ranks.empty() && o.fail_ranks.size() != o.fail_at_steps.size()) {
    return "--fail-rank is given " + std::to_string(o.fail_ranks.size()) +
           " times but --fail-at-step " + std::to_string(o.fail_at_steps.size()) +
           "; give one rank per step, or none (the last rank)";
  }
  return "";
}

}  // namespace

ParsedOptions parse_train_options(int argc, char** argv, bool print) {
  ParsedOptions parsed;
  TrainOptions& o = parsed.options;
  CLI::App app(
      "Trains a byte-level decoder-only transformer with fully_shard (HSDP on a 2x2 mesh by "
      "default) on text files: validation loss and perplexity as it goes, a generated sample "
      "at the end. Exits 0 when the final validation loss is below the corpus's unigram "
      "baseline. Run it with hp-run (or torchrun), e.g. hp-run -n 4 -- train_decoder --data "
      "docs.",
      "train_decoder");
  app.set_config("--config", "",
                 "TOML file of options (names as the long flags, e.g. steps = 600); flags on "
                 "the command line override it");
  app.config_formatter(std::make_shared<TomlConfig>(app));
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.option_defaults()->always_capture_default();
  // In this order in the resolved configuration.
  add_data_options(app, o);
  add_model_options(app, o);
  add_training_options(app, o);
  add_layout_options(app, o);
  add_moe_options(app, o);
  add_runtime_options(app, o);
  add_output_options(app, o);
  add_checkpoint_options(app, o);

  std::ostringstream out, err;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error, out, err);
    if (print) {
      std::fputs(out.str().c_str(), stdout);
      std::fputs(err.str().c_str(), stderr);
    }
    parsed.exit_code = code == 0 ? 0 : 2;
    return parsed;
  }
  const size_t x = o.mesh.find('x');
  o.replicate = std::stoll(o.mesh.substr(0, x));
  o.shard = std::stoll(o.mesh.substr(x + 1));
  if (const std::string message = contradiction(o, app); !message.empty()) {
    if (print) std::fprintf(stderr, "train_decoder: %s (see --help)\n", message.c_str());
    parsed.exit_code = 2;
  }
  parsed.resolved = app.config_to_str(/*default_also=*/true, /*write_description=*/false);
  return parsed;
}

}  // namespace hp::trainer
