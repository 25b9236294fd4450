// The trainer, the project's main job (`make demo`): trains a byte-level decoder-only
// transformer (models/transformer.h) with fully_shard (HSDP on a 2x2 mesh by default; with
// --tp, --cp, --ep and --experts also tensor, context and expert parallelism:
// parallel_layout.h; with --pp, pipeline stages: pipeline_stages.h) on text files:
// training loss and throughput as it goes, validation loss and perplexity every so often,
// a generated sample at the end. Exits 0 when the run finished (with --require-learning,
// only if the final validation loss is below the corpus's unigram baseline), 1 on an
// error, 2 on a usage error. SIGTERM or SIGINT (a preemption) stops every rank after the
// same step, with a last-words checkpoint when --save is given, and exits with 128 + the
// signal (preemption.h).
//   hp-run -n 4 -- build/trainer/train_decoder --data docs [options] (--help)
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "hyperparallel/async_checkpoint.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/fused_optimizers.h"
#include "hyperparallel/trace.h"
#include "trainer/evaluation.h"
#include "trainer/fault_injection.h"
#include "trainer/job.h"
#include "trainer/model_parts.h"
#include "trainer/preemption.h"
#include "trainer/progress.h"
#include "trainer/run_checkpoints.h"
#include "trainer/skipped_steps.h"
#include "trainer/text_data.h"
#include "trainer/train_options.h"
#include "trainer/usage_error.h"

namespace {

using namespace hp::trainer;  // the trainer's parts, in this folder

void write_trace(const std::string& dir, int64_t rank,
                 const std::vector<hp::trace::Event>& events) {
  std::filesystem::create_directories(dir);
  const std::string suffix = "_rank" + std::to_string(rank);
  std::ofstream(dir + "/trace" + suffix + ".json") << hp::trace::to_chrome_json(events, rank);
  std::ofstream(dir + "/timeline" + suffix + ".svg") << hp::trace::to_svg(
      events, "train_decoder, one training step, rank " + std::to_string(rank));
}

// Linear warmup to the peak, then cosine decay to a tenth of it at the last step.
double learning_rate(const TrainOptions& o, int64_t step) {
  if (step <= o.warmup) return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup);
  const double progress = static_cast<double>(step - o.warmup) /
                          static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  return o.lr * (0.1 + 0.45 * (1 + std::cos(M_PI * std::min(1.0, progress))));
}

void set_learning_rate(torch::optim::AdamW& optimizer, const TrainOptions& o, int64_t step) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(o, step));
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
                signal_name(signal).c_str(), static_cast<long long>(step),
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
  TextData data = load_data(o, job);
  if (!o.save.empty()) check_writable("--save", o.save, job);
  if (!o.export_dir.empty()) check_writable("--export", o.export_dir, job);
  if (!o.out.empty()) check_writable("--out", o.out, job);
  const std::string resume_from = checkpoint_to_resume(o, job.rank);

  const std::unique_ptr<ModelParts> model = make_model_parts(o, job.layout);
  if (resume_from.empty()) model->materialize();  // a resumed run loads its values
  const std::vector<at::Tensor> parameters = model->parameters();
  print_header(o, job, data, model->size(), numel_of(parameters), resolved);
  const Evaluation evaluation = model->evaluation();
  const std::unique_ptr<torch::optim::AdamW> adamw =
      o.optimizer_implementation == "fused"
          ? std::make_unique<hp::FusedAdamW>(parameters, torch::optim::AdamWOptions(o.lr))
          : std::make_unique<torch::optim::AdamW>(parameters, torch::optim::AdamWOptions(o.lr));
  torch::optim::AdamW& optimizer = *adamw;
  const int64_t done = resume_from.empty() ? 0 : resume(resume_from, *model, optimizer, job.rank);
  const InjectedFault fault = fault_of_this_attempt(o, job.ranks);
  Summary summary;
  summary.matmul_rate = measured_matmul_rate(job.all());
  Progress progress(o, job, done, data.unigram);  // its clock starts here
  std::optional<double> validation;               // the latest
  // From here on SIGTERM and SIGINT stop the run after a step (before, they end it at
  // once: there is nothing to save yet).
  const PreemptionWatch preemption(
      std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.grace_period * 1000))));
  std::optional<hp::AsyncCheckpointSaver> saver;
  if (o.async_save) saver.emplace();
  SkippedSteps skipped_steps(o, job.rank);

  for (int64_t step = done + 1; step <= o.steps; ++step) {
    fail_if_due(fault, step, job.rank, o.fail_by_kill);
    // The third step: the implicit prefetch order is known and warm-up allocations are done.
    const bool traced = !o.trace.empty() && step == done + 3;
    if (traced) hp::trace::start(job.world->device());
    set_learning_rate(optimizer, o, step);
    optimizer.zero_grad();
    const StepResult result = model->forward_backward(data.batches->at_step(step));
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
      save(o, step, *model, optimizer, job, nullptr, preempted_by);
    } else if (preempted_by == 0 && o.save_every > 0 && step % o.save_every == 0 &&
               step != o.steps) {
      save(o, step, *model, optimizer, job, saver ? &*saver : nullptr);
    }
    if (progress.logs(step) || progress.evaluates(step)) {
      MetricsRecord record = progress.measure(step, mean_loss, result.grad_norm);
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
  if (!o.save.empty()) save(o, o.steps, *model, optimizer, job);
  if (!o.export_dir.empty()) export_full(o, *model, optimizer, job);
  summary.validation_loss =
      validation ? *validation : validation_loss(evaluation.loss_of, data.validation, job.all());
  summary.learned = summary.validation_loss < data.unigram;
  if (o.sample_bytes > 0) {
    summary.sample = generate(evaluation.next_logits, o.prompt, o.sample_bytes, o.seq,
                              static_cast<uint64_t>(o.seed));
  }
  model->check_copies_equal(job.rank);
  summary.peak_rss_mib = torch::empty({job.ranks}, torch::kFloat);
  hp::all_gather(summary.peak_rss_mib, torch::full({1}, peak_rss_mib(), torch::kFloat), job.all())
      .wait();
  print_summary(o, job, data, model->size(), progress, summary);
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
  const ParsedOptions parsed = parse_train_options(argc, argv, is_rank0());
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
