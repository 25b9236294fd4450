#pragma once
// The trainer's options: command-line flags over an optional TOML config file (CLI11).

#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/recompute.h"

namespace hp::trainer {

struct TrainOptions {
  // Data
  std::vector<std::string> data;  // text files and directories
  double validation_fraction = 0.1;
  // Model
  int64_t seq = 64;
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  // Training
  int64_t steps = 500;
  int64_t batch = 32;  // global, in sequences
  double lr = 6e-3;
  // AdamW's step: fused (hp::FusedAdamW, one ATen kernel per device and dtype) | for-loop
  // (torch::optim::AdamW, several kernels per parameter). The same state either way.
  std::string optimizer_implementation = "fused";
  int64_t warmup = 20;     // steps of linear warmup before the cosine decay to lr/10
  double clip_grad = 1.0;  // 0: off
  // A step whose loss or gradient norm is not finite is skipped on every rank; this many
  // in a row stop the run with an error.
  int64_t max_skipped_steps = 3;
  int64_t seed = 0;
  // Parallelism
  std::string mesh = "2x2";    // RxS: data-parallel replicas x shards
  int64_t tp = 1;              // tensor parallel: heads, FFN and vocabulary split over tp ranks
  int64_t cp = 1;              // context parallel: each sequence split over cp ranks
  int64_t ep = 1;              // expert parallel: the experts split over ep of the S shards
  int64_t experts = 0;         // > 0: every odd layer's FFN is a mixture of this many experts
  int64_t top_k = 2;           // experts per token
  double balance_loss = 0.01;  // load-balancing loss coefficient of the MoE layers
  std::string mp = "none";     // none | bf16
  // Pipeline parallel: the layers split into pp x virtual_stages stages over pp ranks (the
  // outermost mesh dimension), each batch into microbatches.
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved | zero-bubble (refused)
  int64_t microbatches = 4;          // per data-parallel rank's batch, under --pp
  int64_t virtual_stages = 1;        // stages per pipeline rank (interleaved: >= 2)
  bool comm_fusion = false;
  int64_t comm_fusion_bucket_bytes = 0;  // per peer and collective; 0: one per module
  // Quantized collectives (hp::CommPolicy): none | int8 | fp8, and values per scale.
  std::string ag_codec = "none";
  std::string rs_codec = "none";
  int64_t codec_block = 256;
  bool error_feedback = false;  // the reduce-scatter's quantization residual carried over
  double timeout =
      0;  // seconds start-up and collectives wait for the others; 0: HP_TIMEOUT_S or 300
  std::string recompute = "none";  // activation recomputation: none | reentrant | non-reentrant
  // Evaluation and output
  int64_t log_every = 0;   // 0: about 20 lines per run
  int64_t eval_every = 0;  // 0: about 5 evaluations per run
  int64_t eval_batches = 8;
  std::string prompt = "fully_shard(";
  int64_t sample_bytes = 160;
  std::string out;  // metrics.jsonl and loss.svg; empty: none
  // Exit 1 unless the final validation loss is below the unigram baseline (the demo's and
  // tests' acceptance check); printed either way.
  bool require_learning = false;
  // Checkpoints and recovery
  std::string save;
  int64_t save_every = 0;
  bool async_save = false;  // --save-every checkpoints written in the background
  std::string resume;
  bool resume_crc = false;  // --resume auto checks every piece's CRC-32 of its candidates
  std::string export_dir;
  // Seconds from SIGTERM / SIGINT to an exit that no longer waits for the last-words
  // checkpoint; below hp-run's --grace-period (30 s), after which the launcher SIGKILLs.
  double grace_period = 25;
  // Fault injection: in attempt k (TORCHELASTIC_RESTART_COUNT) rank fail_ranks[k] (default:
  // the last) fails before step fail_at_steps[k], by an exception or, with fail_by_kill, by
  // SIGKILL.
  std::vector<int64_t> fail_at_steps;
  std::vector<int64_t> fail_ranks;
  bool fail_by_kill = false;
  std::string trace;

  // Derived from `mesh`
  int64_t replicate = 2;
  int64_t shard = 2;
  std::optional<RecomputeOptions> recompute_options() const;
  // Whether the MoE layers add a load-balancing loss to the training loss.
  bool balances_experts() const { return experts > 0 && balance_loss > 0; }
};

struct ParsedOptions {
  TrainOptions options;
  std::string resolved;          // every option's value, as a config file
  std::optional<int> exit_code;  // set: exit now with it (help shown, or a usage error)
};

// Parses the command line. Help and usage errors are printed only when `print` is set
// (rank 0), so that several ranks do not repeat them.
ParsedOptions parse_train_options(int argc, char** argv, bool print);

}  // namespace hp::trainer
