// A collectives self-check: every collective at a few sizes over all ranks, each result
// checked against the value computed locally, with the median time per call.
//   hp-run -n 4 -- build/examples/collectives_check
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "hyperparallel/collectives.h"
#include "hyperparallel/process_group.h"

namespace {

using Clock = std::chrono::steady_clock;

// Rank r's data: exactly representable values that differ per rank and element.
at::Tensor data(int64_t rank, int64_t numel) {
  return at::remainder(at::arange(numel, at::kFloat), 13) + 2 * rank;
}

struct Row {
  const char* op;
  int64_t numel;
  bool ok;
  double median_ms;
};

// Times `run` (which starts a collective and waits for it) a few times, then asks
// `check` whether the last result is right. OK only if it is right on every rank.
Row measure(const char* op, int64_t numel, const hp::Group& world, const std::function<void()>& run,
            const std::function<bool()>& check) {
  std::vector<double> times;
  for (int i = 0; i < 7; ++i) {
    auto start = Clock::now();
    run();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  at::Tensor all_ok = at::full({1}, check() ? 1.0f : 0.0f);
  hp::all_reduce(all_ok, hp::ReduceOp::kMin, world).wait();
  return {op, numel, all_ok.item<float>() == 1.0f, times[times.size() / 2]};
}

}  // namespace

int check() {
  std::shared_ptr<hp::World> world = hp::World::from_env();
  const hp::Group& g = *world->world_group();
  const int64_t w = g.size(), me = g.rank();
  std::vector<Row> rows;
  for (int64_t numel : {int64_t{1024}, int64_t{256 * 1024}}) {
    const int64_t chunk = numel / w;
    at::Tensor total = at::zeros({numel});
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < w; ++r) {
      total += data(r, numel);
      parts.push_back(data(r, numel));
    }
    at::Tensor mine = data(me, numel);
    at::Tensor out = at::empty({w * numel});
    rows.push_back(measure(
        "all_gather", numel, g, [&] { hp::all_gather(out, mine, g).wait(); },
        [&] { return at::equal(out, at::cat(parts)); }));
    at::Tensor scattered = at::empty({chunk});
    rows.push_back(measure(
        "reduce_scatter avg", numel, g,
        [&] { hp::reduce_scatter(scattered, mine, hp::ReduceOp::kAvg, g).wait(); },
        [&] { return at::allclose(scattered, total.narrow(0, me * chunk, chunk) / w); }));
    at::Tensor reduced;
    rows.push_back(measure(
        "all_reduce sum", numel, g,
        [&] {
          reduced = mine.clone();
          hp::all_reduce(reduced, hp::ReduceOp::kSum, g).wait();
        },
        [&] { return at::equal(reduced, total); }));
    at::Tensor exchanged = at::empty({w, chunk});
    rows.push_back(measure(
        "all_to_all", numel, g, [&] { hp::all_to_all(exchanged, mine.view({w, -1}), g).wait(); },
        [&] {
          bool ok = true;
          for (int64_t r = 0; r < w; ++r)
            ok = ok && at::equal(exchanged[r], parts[r].view({w, -1})[me]);
          return ok;
        }));
    at::Tensor broadcasted;
    rows.push_back(measure(
        "broadcast", numel, g,
        [&] {
          broadcasted = mine.clone();
          hp::broadcast(broadcasted, 0, g).wait();
        },
        [&] { return at::equal(broadcasted, parts[0]); }));
  }
  rows.push_back(measure("barrier", 0, g, [&] { hp::barrier(g).wait(); }, [] { return true; }));
  bool all_ok = std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.ok; });
  if (me == 0) {
    std::printf("HyperParallel collectives self-check: %lld ranks, Gloo, fp32\n\n",
                static_cast<long long>(w));
    std::printf("%-20s %12s %8s %12s\n", "op", "elements", "result", "median ms");
    for (const Row& r : rows) {
      std::printf("%-20s %12lld %8s %12.3f\n", r.op, static_cast<long long>(r.numel),
                  r.ok ? "OK" : "WRONG", r.median_ms);
    }
    std::printf("\n%s\n", all_ok ? "all collectives correct" : "SOME COLLECTIVES WRONG");
  }
  return all_ok ? 0 : 1;
}

int main() {
  at::set_num_threads(1);
  try {
    return check();
  } catch (const c10::Error& error) {  // one line, not LibTorch's C++ backtrace
    std::fprintf(stderr, "collectives_check: error: %s\n", error.what_without_backtrace());
    return 1;
  }
}
