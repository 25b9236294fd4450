#include "trainer/progress.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "hyperparallel/collectives.h"
#include "trainer/evaluation.h"
#include "trainer/loss_curve.h"

namespace hp::trainer {
namespace {

using Clock = std::chrono::steady_clock;

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  char text[32];
  std::snprintf(text, sizeof text, s >= 60 ? "%lldm%02llds" : "%llds",
                static_cast<long long>(s >= 60 ? s / 60 : s), static_cast<long long>(s % 60));
  return text;
}

}  // namespace

Progress::Progress(const TrainOptions& o, const Job& job, int64_t done, double unigram)
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
    records_ = read_metrics(o.out + "/metrics.jsonl", done);
    metrics_.emplace(o.out + "/metrics.jsonl", records_);
  }
}

MetricsRecord Progress::measure(int64_t step, double loss, double grad_norm) {
  const auto now = Clock::now();
  MetricsRecord record;
  record.step = step;
  record.loss = loss;
  record.grad_norm = grad_norm;
  tokens_per_s_ = static_cast<double>((step - last_report_step_) * o_.batch * o_.seq) /
                  std::chrono::duration<double>(now - last_report_).count();
  record.tokens_per_s = tokens_per_s_;
  record.elapsed_s = std::chrono::duration<double>(now - start_).count();
  return record;
}

void Progress::report(const MetricsRecord& record) {
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
  std::snprintf(line, sizeof line,
                "step %6lld/%lld  loss %.4f%s  grad norm %6.3f  %7.0f tok/s  ETA %s",
                static_cast<long long>(record.step), static_cast<long long>(o_.steps), record.loss,
                balance, record.grad_norm, record.tokens_per_s, duration_text(eta).c_str());
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

void print_header(const TrainOptions& o, const Job& job, const TextData& data,
                  const ModelSize& size, int64_t local_params, const std::string& resolved) {
  if (job.rank != 0) return;
  const TextCorpus& corpus = *data.corpus;
  std::printf(
      "train_decoder: byte-level language model on %zu text files (%s training bytes, "
      "%s validation bytes); unigram baseline %.4f nats per byte\n",
      corpus.files().size(), with_commas(corpus.size(Split::kTrain)).c_str(),
      with_commas(corpus.size(Split::kValidation)).c_str(), data.unigram);
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

void print_summary(const TrainOptions& o, const Job& job, const TextData& data,
                   const ModelSize& size, const Progress& progress, const Summary& summary) {
  if (job.rank != 0) return;
  if (!o.out.empty()) {
    const std::string svg =
        loss_curve_svg(progress.records(),
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

double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with("VmHWM:")) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return 0;
}

}  // namespace hp::trainer
