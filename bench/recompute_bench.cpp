// Benchmark of activation recomputation's early stop (include/hyperparallel/recompute.h):
// forward and backward of decoder blocks (models/transformer.h) without recomputation,
// with every block recomputed whole, and with early stop, which ends each block's rerun at
// the input of its last matmul (the SwiGLU's down projection). The variants run in turn
// within each step, so that they share the machine's state; means over the timed steps.
//
//   recompute_bench --blocks 4 --steps 5
//
// One process, no communication. Prints one "RESULT {json}" line (bench/report.py reads it).
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hyperparallel/recompute.h"
#include "models/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int64_t blocks = 4;
  int64_t dim = 512;
  int64_t ffn_hidden = 2048;
  int64_t batch = 8;
  int64_t seq = 128;
  int64_t steps = 5;
  int64_t warmup = 1;
  std::string label;  // bench/run.sh's name of the run, copied into the result
};

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The variants: no recomputation, and recomputation of every block with early stop off and on.
const std::vector<std::pair<std::string, std::optional<hp::RecomputeOptions>>>& variants() {
  static const std::vector<std::pair<std::string, std::optional<hp::RecomputeOptions>>> all = {
      {"none", std::nullopt},
      {"whole", hp::RecomputeOptions{.early_stop = false}},
      {"early_stop", hp::RecomputeOptions{.early_stop = true}},
  };
  return all;
}

int run(const Options& o) {
  torch::manual_seed(0);
  hp::models::TransformerConfig config;
  config.dim = o.dim;
  config.heads = 8;
  config.ffn_hidden = o.ffn_hidden;
  config.max_seq = o.seq;
  std::vector<hp::models::DecoderBlock> blocks;
  for (int64_t i = 0; i < o.blocks; ++i) blocks.emplace_back(config);
  const at::Tensor x = torch::randn({o.batch, o.seq, o.dim});

  std::map<std::string, std::vector<double>> forward_ms, backward_ms;
  std::map<std::string, double> checksum;  // the input's gradient: every variant computes it
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    for (const auto& [name, recompute] : variants()) {
      for (auto& block : blocks) block->zero_grad();
      const at::Tensor input = x.clone().requires_grad_(true);
      auto start = Clock::now();
      at::Tensor h = input;
      for (auto& block : blocks) {
        h = recompute ? hp::recompute([block](const at::Tensor& y) mutable { return block(y); }, h,
                                      *recompute)
                      : block(h);
      }
      const at::Tensor loss = h.pow(2).mean();
      const auto forward_end = Clock::now();
      loss.backward();
      const auto backward_end = Clock::now();
      if (step < o.warmup) continue;
      forward_ms[name].push_back(ms_between(start, forward_end));
      backward_ms[name].push_back(ms_between(forward_end, backward_end));
      checksum[name] = input.grad().to(at::kDouble).abs().sum().item<double>();
    }
  }
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double value : v) sum += value;
    return sum / static_cast<double>(v.size());
  };
  nlohmann::json per_variant;
  for (const auto& [name, recompute] : variants()) {
    per_variant[name] = {{"forward_ms", mean(forward_ms[name])},
                         {"backward_ms", mean(backward_ms[name])},
                         {"input_grad_abs_sum", checksum[name]}};
  }
  const nlohmann::json result = {
      {"label", o.label},
      {"model", std::to_string(o.blocks) + " decoder blocks, dim " + std::to_string(o.dim) +
                    ", ffn " + std::to_string(o.ffn_hidden) + ", batch " + std::to_string(o.batch) +
                    " x " + std::to_string(o.seq)},
      {"threads", at::get_num_threads()},
      {"steps", o.steps},
      {"variants", per_variant}};
  std::printf("RESULT %s\n", result.dump().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app("activation recomputation benchmark: early stop against whole reruns");
  app.add_option("--blocks", o.blocks)->check(CLI::PositiveNumber);
  app.add_option("--dim", o.dim)->check(CLI::PositiveNumber);
  app.add_option("--ffn-hidden", o.ffn_hidden)->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch)->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq)->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--label", o.label, "a name for the run, copied into the result");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "recompute_bench: %s\n", error.what());
    return 1;
  }
}
