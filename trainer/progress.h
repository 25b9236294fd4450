#pragma once
// What a run tells as it goes and at its end: the header, the log lines and metrics.jsonl
// (rank 0), throughput, and the summary (sample, peak memory, MFU, validation loss).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "trainer/job.h"
#include "trainer/metrics_log.h"
#include "trainer/model_parts.h"
#include "trainer/text_data.h"
#include "trainer/train_options.h"

namespace hp::trainer {

// The log lines, metrics.jsonl and throughput as the run goes.
class Progress {
 public:
  Progress(const TrainOptions& o, const Job& job, int64_t done, double unigram);

  bool logs(int64_t step) const { return step % log_every_ == 0 || step == o_.steps; }
  bool evaluates(int64_t step) const { return step % eval_every_ == 0 || step == o_.steps; }

  // The step's record with the throughput since the last report.
  MetricsRecord measure(int64_t step, double loss, double grad_norm);

  // Rank 0 prints and logs `record`. The clock restarts: evaluation does not count against
  // throughput.
  void report(const MetricsRecord& record);

  // Ends the progress bar's line.
  void finish() const {
    if (tty_ && rank_ == 0) std::printf("\n");
  }

  const std::vector<MetricsRecord>& records() const { return records_; }
  double tokens_per_s() const { return tokens_per_s_; }

 private:
  const TrainOptions& o_;
  int64_t rank_, done_;
  double unigram_;
  bool tty_;
  int64_t log_every_, eval_every_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(),
                                        last_report_ = start_;
  int64_t last_report_step_;
  double tokens_per_s_ = 0;
  std::vector<MetricsRecord> records_;  // rank 0's, with --out
  std::optional<MetricsLog> metrics_;
};

// Rank 0 tells what the run trains, on what, how (the resolved configuration).
void print_header(const TrainOptions& o, const Job& job, const TextData& data,
                  const ModelSize& size, int64_t local_params, const std::string& resolved);

// What rank 0 prints at the end; `learned`: the verdict.
struct Summary {
  double validation_loss = 0;
  bool learned = false;
  std::string sample;
  at::Tensor peak_rss_mib;  // [ranks]
  double matmul_rate = 0;   // FLOP/s, measured before training
};

void print_summary(const TrainOptions& o, const Job& job, const TextData& data,
                   const ModelSize& size, const Progress& progress, const Summary& summary);

// The fp32 matmul rate one rank reaches while all ranks measure at once (they share the
// machine as they do while training), in FLOP/s; the mean over the ranks.
double measured_matmul_rate(const hp::Group& all);

// Peak resident set size of this process (VmHWM), in MiB.
double peak_rss_mib();

}  // namespace hp::trainer
