// Benchmark of the pipeline schedules (include/hyperparallel/pipeline.h): step time, the
// share of it each stage waits for the others (the bubble) and the activation memory a
// stage holds, next to what each schedule's theory predicts.
//
//   hp-run -n 4 -- pipeline_bench --schedule 1f1b --microbatches 8
//
// A stage's compute is timed work of a fixed duration: forward --forward-ms, backward twice
// that (a model's usual ratio), split evenly over a rank's chunks. It sleeps instead of
// computing, so that S ranks sharing fewer cores (2 here for 4 ranks) still run their
// stages side by side, as S devices would; the schedule, its transfers and its waits are
// the real ones. Each microbatch's forward keeps --activation-mib of activations per stage
// for its backward (allocated, and counted from its forward to its backward: the most a
// rank holds at once is reported); sent tensors are small, so the per-stage compute is far
// larger than the transfers.
//
// --split-backward instead times the backward of two d512 decoder blocks
// (models/transformer.h) whole, and split into its input-gradient and weight-gradient
// halves (two autograd passes), as a zero-bubble schedule would run it.
//
// Rank 0 prints one "RESULT {json}" line (bench/report.py reads it).
#include <torch/csrc/autograd/autograd.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "hyperparallel/collectives.h"
#include "hyperparallel/pipeline.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/trace.h"
#include "models/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string schedule = "1f1b";
  int64_t microbatches = 8;
  int64_t virtual_stages = 2;  // interleaved only
  double forward_ms = 20;
  double activation_mib = 16;
  int64_t steps = 4;
  int64_t warmup = 1;
  bool split_backward = false;
  std::string label;  // bench/run.sh's name of the run, copied into the result
};

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void sleep_ms(double ms) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// Activations held at once by this rank's stages (forwards whose backward has not run),
// and the most of them during a step.
std::atomic<int64_t> g_held{0}, g_most_held{0};

// A forward of `forward_ms` that keeps `activation_floats` of activations for its
// backward (allocated, not written: the count, not the page faults, is what is measured),
// and a backward of twice that. The output is the input.
struct TimedWork : torch::autograd::Function<TimedWork> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            double forward_ms, int64_t activation_floats) {
    sleep_ms(forward_ms);
    ctx->save_for_backward({at::empty({activation_floats})});
    ctx->saved_data["backward_ms"] = 2 * forward_ms;
    const int64_t held = ++g_held;
    int64_t most = g_most_held.load();
    while (held > most && !g_most_held.compare_exchange_weak(most, held)) {
    }
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    sleep_ms(ctx->saved_data["backward_ms"].toDouble());
    ctx->get_saved_variables();  // released with the graph after this backward
    --g_held;
    return {grads[0].clone(), at::Tensor(), at::Tensor()};
  }
};

// The theory's idle share of a step for S stages, M microbatches, V chunks per rank.
double theoretical_bubble(const std::string& schedule, int64_t stages, int64_t microbatches,
                          int64_t chunks) {
  const double s = static_cast<double>(stages), m = static_cast<double>(microbatches);
  const double v = schedule == "interleaved" ? static_cast<double>(chunks) : 1.0;
  return (s - 1) / (v * m + s - 1);
}

int run_schedule(const Options& o) {
  auto world = hp::default_world();
  const hp::GroupPtr pp = world->world_group();
  const int64_t ranks = pp->size(), rank = pp->rank();
  const bool interleaved = o.schedule == "interleaved";
  const int64_t chunks = interleaved ? o.virtual_stages : 1;
  const double chunk_forward_ms = o.forward_ms / static_cast<double>(chunks);
  const auto activation_floats =
      static_cast<int64_t>(o.activation_mib * 1048576.0 / 4.0 / static_cast<double>(chunks));
  std::vector<hp::PipelineStage> parts;
  for (int64_t v = 0; v < chunks; ++v) {
    parts.push_back({.forward =
                         [=](const at::Tensor& x) {
                           return TimedWork::apply(x, chunk_forward_ms, activation_floats);
                         },
                     .group = pp});
  }
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) {
    return torch::mse_loss(output, target);
  };
  std::unique_ptr<hp::PipelineSchedule> schedule;
  if (o.schedule == "gpipe") {
    schedule = std::make_unique<hp::GPipeSchedule>(parts.front(), o.microbatches, loss);
  } else if (o.schedule == "1f1b") {
    schedule = std::make_unique<hp::OneFOneBSchedule>(parts.front(), o.microbatches, loss);
  } else if (interleaved) {
    schedule = std::make_unique<hp::InterleavedOneFOneBSchedule>(parts, o.microbatches, loss);
  } else {
    throw std::invalid_argument("--schedule must be gpipe, 1f1b or interleaved, not " + o.schedule);
  }
  // Requires grad: the timed work has no parameters, so that the first stage has a backward.
  const at::Tensor input = torch::randn({o.microbatches * 4, 64}).requires_grad_(true);
  const at::Tensor target = torch::randn({o.microbatches * 4, 64});
  std::vector<double> step_ms, wait_ms;
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    hp::barrier(*pp).wait();
    hp::trace::start();
    g_most_held = 0;
    const auto start = Clock::now();
    schedule->step(rank == 0 ? input : at::Tensor(), rank == ranks - 1 ? target : at::Tensor());
    const auto end = Clock::now();
    double waited = 0;
    double wait_began = 0;
    for (const auto& event : hp::trace::stop()) {
      if (event.op != "pp_recv") continue;
      if (event.kind == hp::trace::Kind::kWaitBegin) wait_began = event.time_us;
      if (event.kind == hp::trace::Kind::kWaitEnd) waited += (event.time_us - wait_began) / 1000.0;
    }
    if (step >= o.warmup) {
      step_ms.push_back(ms_between(start, end));
      wait_ms.push_back(waited);
    }
  }
  const double chunk_activation_mib = static_cast<double>(activation_floats) * 4 / 1048576.0;
  const double most_activation_mib = static_cast<double>(g_most_held) * chunk_activation_mib;
  // Per rank: mean step, mean wait, most activations held (last step); gathered to rank 0.
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / static_cast<double>(v.size());
  };
  at::Tensor mine =
      torch::tensor({mean(step_ms), mean(wait_ms), most_activation_mib}, torch::kDouble);
  at::Tensor all = at::empty({ranks * 3}, torch::kDouble);
  hp::all_gather(all, mine, *pp).wait();
  if (rank == 0) {
    nlohmann::json per_rank = nlohmann::json::array();
    double slowest = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const double step = all[r * 3].item<double>(), wait = all[r * 3 + 1].item<double>();
      slowest = std::max(slowest, step);
      per_rank.push_back({{"step_ms", step},
                          {"wait_ms", wait},
                          {"bubble", wait / step},
                          {"activations_mib", all[r * 3 + 2].item<double>()}});
    }
    const double compute_ms = 3 * o.forward_ms * static_cast<double>(o.microbatches);
    const nlohmann::json result = {
        {"label", o.label},
        {"schedule", o.schedule},
        {"stages", ranks},
        {"microbatches", o.microbatches},
        {"virtual_stages", chunks},
        {"forward_ms", o.forward_ms},
        {"activation_mib", o.activation_mib},
        {"steps", o.steps},
        {"step_ms", slowest},
        {"compute_ms", compute_ms},
        {"bubble", 1 - compute_ms / slowest},
        {"theoretical_bubble", theoretical_bubble(o.schedule, ranks, o.microbatches, chunks)},
        {"ranks", per_rank},
    };
    std::printf("RESULT %s\n", result.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

// The backward of two decoder blocks whole, and as a zero-bubble schedule splits it: the
// input's gradient first (autograd::grad to the input), the weights' later (a second pass
// to the parameters, which LibTorch's engine can only run from the output again).
int run_split_backward(const Options& o) {
  torch::manual_seed(0);
  hp::models::TransformerConfig config;
  config.dim = 512;
  config.heads = 8;
  config.ffn_hidden = 2048;
  config.max_seq = 128;
  std::vector<hp::models::DecoderBlock> blocks = {hp::models::DecoderBlock(config),
                                                  hp::models::DecoderBlock(config)};
  std::vector<at::Tensor> params;
  for (auto& block : blocks) {
    for (auto& p : block->parameters()) params.push_back(p);
  }
  const at::Tensor x = torch::randn({8, 128, 512});
  const auto forward = [&](const at::Tensor& input) {
    at::Tensor h = input;
    for (auto& block : blocks) h = block(h);
    return h;
  };
  std::vector<double> whole_ms, input_ms, weight_ms;
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    at::Tensor input = x.clone().requires_grad_(true);
    at::Tensor y = forward(input);
    const at::Tensor grad = torch::ones_like(y);
    auto start = Clock::now();
    torch::autograd::backward({y}, {grad});
    const double whole = ms_between(start, Clock::now());
    input = x.clone().requires_grad_(true);
    y = forward(input);
    start = Clock::now();
    torch::autograd::grad({y}, {input}, {grad}, /*retain_graph=*/true);
    const double input_half = ms_between(start, Clock::now());
    start = Clock::now();
    torch::autograd::grad({y}, params, {grad});
    const double weight_half = ms_between(start, Clock::now());
    if (step >= o.warmup) {
      whole_ms.push_back(whole);
      input_ms.push_back(input_half);
      weight_ms.push_back(weight_half);
    }
  }
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / static_cast<double>(v.size());
  };
  const nlohmann::json result = {{"label", o.label},
                                 {"split_backward", true},
                                 {"model", "2 decoder blocks, dim 512, ffn 2048, batch 8 x 128"},
                                 {"steps", o.steps},
                                 {"whole_ms", mean(whole_ms)},
                                 {"input_grad_ms", mean(input_ms)},
                                 {"weight_grad_ms", mean(weight_ms)}};
  std::printf("RESULT %s\n", result.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app("pipeline schedule benchmark");
  app.add_option("--schedule", o.schedule, "gpipe, 1f1b or interleaved");
  app.add_option("--microbatches", o.microbatches);
  app.add_option("--virtual-stages", o.virtual_stages, "chunks per rank (interleaved)");
  app.add_option("--forward-ms", o.forward_ms, "a stage's forward of one microbatch");
  app.add_option("--activation-mib", o.activation_mib, "activations a stage keeps per microbatch");
  app.add_option("--steps", o.steps);
  app.add_option("--warmup", o.warmup);
  app.add_option("--label", o.label, "a name for the run, copied into the result");
  app.add_flag("--split-backward", o.split_backward,
               "time a backward whole and split in halves instead (one process)");
  CLI11_PARSE(app, argc, argv);
  try {
    return o.split_backward ? run_split_backward(o) : run_schedule(o);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pipeline_bench: %s\n", error.what());
    return 1;
  }
}
