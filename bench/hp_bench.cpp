// Benchmark of fully_shard's modes against a plain data-parallel baseline and a
// compute-only reference, on the decoder of models/transformer.h or on a model of many
// tiny blocks (scheduling overhead). All variants live in one process and are stepped in
// rotation, so that a machine whose load drifts (shared cores) slows all of them alike.
//
//   hp-run -n 2 -- hp_bench --variants local,ddp,hp,hp:fusion --dim 256 --layers 4
//
// Variants:
//   local          the plain model on this rank's batch: compute only, no communication
//   ddp            the plain model replicated; after backward one all-reduce of all
//                  gradients (flattened into one buffer), then the optimizer
//   comm           communication only: the collectives of `hp` (default options) for this
//                  model, module by module, each waited before the next, no compute.
//                  Its step time is the serial communication time of a step.
//                  comm:keep: the same for reshard_after_forward = false (no all-gather
//                  in backward). comm:keep+gloo: with Gloo's own reduce-scatter (an
//                  all-reduce of the whole input), as FSDP2 on Gloo runs it.
//                  comm:int8ag+int8rs (or fp8): the quantized collectives of `hp` with
//                  those codecs (a module's parameters in one collective, random values,
//                  so that quantizing costs what it does in training). comm:fusion: full
//                  precision, a module's parameters in one collective, as comm_fusion.
//   hp[:flags]     fully_shard on every block and the root; flags (joined by "+"):
//                    fusion   options.comm_fusion = true
//                    bucket   with fusion: options.comm_fusion_bucket_bytes = 128 KiB
//                    nopf     root.set_implicit_prefetch(false)
//                    keep     options.reshard_after_forward = false
//                    int8ag, fp8ag   options.comm_policy.all_gather_codec
//                    int8rs, fp8rs   options.comm_policy.reduce_scatter_codec
//                    ef       options.comm_policy.error_feedback = true
//                    raf2     options.reshard_after_forward = 2 (blocks keep 1/2 after
//                             forward; backward all-gathers within pairs of ranks)
//                    fusedopt hp::FusedAdamW instead of torch::optim::AdamW (every
//                             variant else steps with torch::optim::AdamW)
// --deferred-init builds every variant's model with hp::deferred_init and materializes it
// after fully_shard (the same values as an eager build, bit for bit): a rank then never
// holds more than its shards and about one whole parameter, also while initializing.
// Rank 0 prints one "RESULT {json}" line per variant (bench/report.py reads them), with
// the model's sizes, peak RSS (VmHWM) and RSS at the end of the last step's forward (the
// forward/backward boundary) of every rank, and the RLIMIT_DATA the process ran under.
// --trace DIR records the last timed step of every hp variant on every rank as
// DIR/<variant>_rank<R>.json (Chrome trace) and .svg (timeline picture).
// --checkpoint DIR times checkpoint saves instead of variants: how long a training step is
// blocked by save_sharded_checkpoint and by AsyncCheckpointSaver::save (both stagings:
// fork, copy), how long the background write takes and how fast training runs meanwhile
// (one RESULT line; see run_checkpoint below). The checkpoints go under DIR and are removed.
// Every variant computes on the World's device (World::device(): a GPU per rank when
// every rank has one); on a GPU each phase's time ends with a device synchronization, so
// it is device time, not launch time.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "hyperparallel/async_checkpoint.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/deferred_init.h"
#include "hyperparallel/fully_shard.h"
#include "hyperparallel/fused_optimizers.h"
#include "hyperparallel/materialize.h"
#include "hyperparallel/mesh.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/quantized_collectives.h"
#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/trace.h"
#include "models/transformer.h"
#include "src/distributed/group_access.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "transformer";  // or "tiny"
  int64_t dim = 256, layers = 4, heads = 4, vocab = 1024, seq = 64, batch = 2;
  int64_t tiny_blocks = 64, tiny_width = 8;
  int64_t replicate = 1, shard = 0;  // shard 0: all ranks
  int64_t steps = 8, warmup = 2;
  std::string variants = "local,ddp,hp";
  std::string label;
  std::string trace_dir;       // empty: no trace
  std::string checkpoint_dir;  // set: the checkpoint benchmark instead of the variants
  int64_t saves = 3;           // timed saves of each kind
  bool count_copies = true;
  bool deferred_init = false;
};

// --help prints the options and exits; an unknown option or a bad value exits with 2.
Options parse_args(int argc, char** argv) {
  Options o;
  CLI::App app("Times fully_shard's modes against plain data parallelism (bench/run.sh).");
  app.add_option("--model", o.model, "the decoder, or many tiny blocks")
      ->check(CLI::IsMember({"transformer", "tiny"}));
  app.add_option("--dim", o.dim)->check(CLI::PositiveNumber);
  app.add_option("--layers", o.layers)->check(CLI::NonNegativeNumber);
  app.add_option("--heads", o.heads)->check(CLI::PositiveNumber);
  app.add_option("--vocab", o.vocab)->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq)->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "sequences per rank")->check(CLI::PositiveNumber);
  app.add_option("--tiny-blocks", o.tiny_blocks)->check(CLI::PositiveNumber);
  app.add_option("--tiny-width", o.tiny_width)->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--variants", o.variants, "comma-separated (see the top of hp_bench.cpp)");
  app.add_option("--label", o.label, "copied into every RESULT line");
  app.add_option("--trace", o.trace_dir, "DIR: a trace of the last timed step of hp variants");
  app.add_option("--checkpoint", o.checkpoint_dir,
                 "DIR: time checkpoint saves (sync and async) of the hp model, written under DIR");
  app.add_option("--saves", o.saves, "timed saves of each kind (--checkpoint)")
      ->check(CLI::PositiveNumber);
  app.add_flag("!--no-copy-count", o.count_copies, "skip the untimed step that counts copies");
  app.add_flag("--deferred-init", o.deferred_init, "hp::deferred_init, fully_shard, materialize");
  std::string mesh;
  app.add_option("--mesh", mesh, "RxS: replicate x shard ranks (default 1xWORLD)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            const auto x = text.find('x');
            const bool ok = x != std::string::npos && x > 0 && x + 1 < text.size() &&
                            text.find_first_not_of("0123456789x") == std::string::npos &&
                            text.find('x', x + 1) == std::string::npos;
            return ok ? "" : "needs RxS, e.g. 2x2";
          },
          "RxS", "mesh"));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    std::exit(app.exit(error) == 0 ? 0 : 2);  // --help: 0
  }
  if (!mesh.empty()) {
    const auto x = mesh.find('x');
    o.replicate = std::stoll(mesh.substr(0, x));
    o.shard = std::stoll(mesh.substr(x + 1));
  }
  return o;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, sep);) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// Many tiny blocks: compute and communication are negligible, so the step time is the
// per-module cost of the framework (hooks, bookkeeping, collective launch latency).
struct TinyImpl : torch::nn::Module {
  TinyImpl(int64_t blocks, int64_t width) {
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < blocks; ++i) {
      layers.emplace_back(torch::nn::Linear(width, width));
      list->push_back(layers.back().ptr());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = layer(x);
    return x;
  }
  std::vector<hp::Sharded<torch::nn::Linear>> layers;
};
TORCH_MODULE(Tiny);

// Bytes written by aten::copy_ and aten::cat, in every thread of the process (c10d's
// Gloo worker threads included). Counted in one separate, untimed step: the callback
// slows every op down.
// Split by thread: the main thread (model, autograd, fully_shard) and the others (c10d's
// Gloo workers, which copy between user tensors and their own buffers).
std::atomic<int64_t> g_copied_bytes{0};
std::atomic<int64_t> g_copied_bytes_comm{0};
std::thread::id g_main_thread;

int64_t tensor_bytes(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  }
  int64_t sum = 0;
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList().vec()) sum += t.numel() * t.element_size();
  }
  return sum;
}

std::unique_ptr<at::ObserverContext> count_copy(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  if ((name == "aten::copy_" || name == "aten::cat") && !fn.inputs().empty()) {
    // copy_(self, src): self is written; cat(tensors): the output is their total.
    const int64_t bytes = tensor_bytes(fn.inputs()[0]);
    (std::this_thread::get_id() == g_main_thread ? g_copied_bytes : g_copied_bytes_comm) += bytes;
  }
  return nullptr;
}

double status_mib(const char* field) {
  std::ifstream status("/proc/self/status");
  const std::string prefix = std::string(field) + ":";
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with(prefix)) return std::atof(line.c_str() + prefix.size()) / 1024.0;
  }
  return 0;
}

struct Variant {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::function<void()> after_backward;  // ddp's gradient all-reduce
  // comm: replaces forward and backward; returns {forward ms, backward ms}.
  std::function<std::array<double, 2>()> comm_step;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  // fwd, bwd, opt, step, CPU time of the process (all threads): max over ranks
  std::vector<std::array<double, 5>> times;
  int64_t copied_bytes = -1;       // main thread
  int64_t copied_bytes_comm = -1;  // other threads (Gloo)
  double boundary_rss_mib = 0;     // VmRSS at the end of the last step's forward
  double last_loss = 0;            // the last timed step's loss on this rank
  int64_t wire_bytes = 0;          // sent by this rank in the timed steps (hp::wire_bytes)
};

// Milliseconds and MiB to 3 decimals in the RESULT lines.
double rounded(double v) { return std::round(v * 1000.0) / 1000.0; }

// The collectives fully_shard issues for `model` (blocks = children of "layers", the rest
// belongs to the root), per-parameter mode, issued module by module and waited at once:
// the time communication takes when nothing overlaps it. The root never reshards after
// forward; the blocks do if `reshard_after_forward` (then backward all-gathers again).
std::function<std::array<double, 2>()> comm_only_step(torch::nn::Module& model,
                                                      const hp::DeviceMesh& mesh,
                                                      bool reshard_after_forward,
                                                      bool gloo_reduce_scatter, bool fused,
                                                      const hp::CommPolicy& policy) {
  std::vector<std::vector<at::Tensor>> modules(1);  // [0]: the root's own parameters
  std::shared_ptr<torch::nn::Module> layers;
  for (const auto& child : model.named_children()) {
    if (child.key() == "layers") {
      layers = child.value();
    } else {
      for (const auto& p : child.value()->parameters()) modules[0].push_back(p.detach());
    }
  }
  for (const auto& p : model.named_parameters(/*recurse=*/false)) modules[0].push_back(p.value());
  for (const auto& block : layers->children()) modules.push_back(block->parameters());
  const hp::GroupPtr shard = mesh.group(mesh.dim_names().back());
  const hp::GroupPtr replicate = mesh.ndim() == 2 ? mesh.group(mesh.dim_names().front()) : nullptr;
  // Its times are host waits for Gloo's host-side collectives.
  if (!shard->device().is_cpu()) {
    throw std::invalid_argument("the comm variants time Gloo on the CPU; this World runs on " +
                                shard->device().str());
  }
  const int64_t w = shard->size();
  auto shard_numel = [w](const at::Tensor& p) {
    const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
    return (rows + w - 1) / w * (p.numel() / std::max<int64_t>(rows, 1));
  };
  // As fully_shard: quantized only where something travels.
  const bool quantized_gather =
      shard->communicates() && policy.all_gather_codec != hp::CommCodec::kNone;
  const bool quantized_reduce =
      shard->communicates() && policy.reduce_scatter_codec != hp::CommCodec::kNone;
  auto module_numel = [shard_numel](const std::vector<at::Tensor>& params) {
    int64_t total = 0;
    for (const auto& p : params) total += shard_numel(p);
    return total;
  };
  auto gather = [shard, w, shard_numel, module_numel, fused, quantized = quantized_gather,
                 policy](const std::vector<at::Tensor>& params) {
    if (fused && !quantized) {
      const int64_t total = module_numel(params);
      hp::all_gather(torch::empty({w * total}), torch::zeros({total}), *shard).wait();
      return;
    }
    std::vector<hp::CommHandle> handles;
    std::vector<at::Tensor> inputs, outputs;
    for (const auto& p : params) {
      inputs.push_back(quantized ? torch::randn({shard_numel(p)}) : torch::zeros({shard_numel(p)}));
      outputs.push_back(torch::empty({w * shard_numel(p)}));
      if (!quantized) handles.push_back(hp::all_gather(outputs.back(), inputs.back(), *shard));
    }
    if (quantized) {
      handles.push_back(hp::quantized_all_gather_coalesced(
          outputs, inputs, *shard, policy.all_gather_codec, policy.block_size));
    }
    for (auto& h : handles) h.wait();
  };
  auto reduce_scatter = [shard, gloo_reduce_scatter](at::Tensor out, at::Tensor in) {
    if (!gloo_reduce_scatter || shard->size() == 1) {
      return hp::reduce_scatter(out, in, hp::ReduceOp::kSum, *shard);
    }
    return hp::CommHandle::from_work(hp::detail::GroupAccess::backend(*shard, c10::DeviceType::CPU)
                                         ._reduce_scatter_base(out, in, {}));
  };
  auto reduce = [reduce_scatter, replicate, w, shard_numel, module_numel, shard, fused,
                 quantized = quantized_reduce, policy](const std::vector<at::Tensor>& params) {
    std::vector<hp::CommHandle> handles;
    std::vector<at::Tensor> inputs, outputs;
    const int64_t total = module_numel(params);
    at::Tensor buffer = torch::zeros({total});
    int64_t offset = 0;
    for (const auto& p : fused && !quantized ? std::vector<at::Tensor>{} : params) {
      inputs.push_back(quantized ? torch::randn({w * shard_numel(p)})
                                 : torch::ones({w * shard_numel(p)}));
      outputs.push_back(buffer.narrow(0, offset, shard_numel(p)));
      if (!quantized) handles.push_back(reduce_scatter(outputs.back(), inputs.back()));
      offset += shard_numel(p);
    }
    if (fused && !quantized) {
      handles.push_back(reduce_scatter(buffer, torch::ones({w * total})));
    } else if (quantized) {
      handles.push_back(hp::quantized_reduce_scatter_coalesced(outputs, inputs, hp::ReduceOp::kSum,
                                                               *shard, policy.reduce_scatter_codec,
                                                               policy.block_size));
    }
    for (auto& h : handles) h.wait();
    if (replicate && replicate->size() > 1) {
      hp::all_reduce(buffer, hp::ReduceOp::kSum, *replicate).wait();
    }
  };
  return [modules, gather, reduce, reshard_after_forward] {
    const auto t0 = Clock::now();
    for (const auto& m : modules) gather(m);  // root first, then the blocks in order
    const auto t1 = Clock::now();
    for (size_t i = modules.size(); i-- > 1;) {
      if (reshard_after_forward) gather(modules[i]);
      reduce(modules[i]);
    }
    reduce(modules[0]);  // the root's backward ends last
    const auto t2 = Clock::now();
    auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    return std::array<double, 2>{ms(t0, t1), ms(t1, t2)};
  };
}

void write_trace(const Options& o, const std::string& variant, int64_t rank,
                 const std::vector<hp::trace::Event>& events) {
  std::filesystem::create_directories(o.trace_dir);
  std::string name = variant;
  std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  const std::string path = o.trace_dir + "/" + name + "_rank" + std::to_string(rank);
  std::ofstream(path + ".json") << hp::trace::to_chrome_json(events, static_cast<int>(rank));
  std::ofstream(path + ".svg") << hp::trace::to_svg(
      events, "hp_bench " + variant + " " + o.label + ", one step, rank " + std::to_string(rank));
}

// CPU time used by all threads of this process (main thread, Gloo workers, kernel work
// done on their behalf), in ms.
double process_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

// Linear interpolation between order statistics (numpy's default); q = 0.5: the median.
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

// ---- Where the variants run ------------------------------------------------------------

struct Setting {
  std::shared_ptr<hp::World> world;
  hp::DeviceMesh mesh;       // replicate x shard, or shard alone
  int64_t replicate, shard;  // its sizes
  int64_t rank, ranks;
  const hp::Group& all() const { return *world->world_group(); }
  c10::Device device() const { return world->device(); }
};

Setting make_setting(const Options& o) {
  std::shared_ptr<hp::World> world = hp::default_world();
  const int64_t ranks = world->size();
  const int64_t replicate = o.replicate, shard = o.shard == 0 ? ranks : o.shard;
  if (replicate * shard != ranks) {
    throw std::invalid_argument("--mesh needs " + std::to_string(replicate * shard) + " ranks");
  }
  hp::DeviceMesh mesh =
      replicate == 1 ? hp::DeviceMesh(world, {{"dp_shard", shard}})
                     : hp::DeviceMesh(world, {{"dp_replicate", replicate}, {"dp_shard", shard}});
  return Setting{world, std::move(mesh), replicate, shard, world->rank(), ranks};
}

hp::models::TransformerConfig transformer_config(const Options& o) {
  hp::models::TransformerConfig config;
  config.vocab = o.vocab;
  config.dim = o.dim;
  config.heads = o.heads;
  config.layers = o.layers;
  config.ffn_hidden = 4 * o.dim;
  config.max_seq = o.seq;
  return config;
}

// ---- The variants ----------------------------------------------------------------------

// The model's sizes before sharding (meta tensors count too); set by the first variant built.
struct ModelSizes {
  int64_t params = -1;
  int64_t block_params = -1;
};

// The plain baseline's gradient sync: all gradients in one buffer, one blocking all-reduce.
std::function<void()> ddp_all_reduce(std::vector<at::Tensor> params, const hp::Group& all) {
  return [params = std::move(params), &all] {
    std::vector<at::Tensor> flat;
    for (const auto& p : params) flat.push_back(p.grad().view(-1));
    at::Tensor buffer = at::cat(flat);
    hp::all_reduce(buffer, hp::ReduceOp::kSum, all).wait();
    buffer.div_(static_cast<double>(all.size()));
    int64_t offset = 0;
    for (const auto& p : params) {
      p.grad().view(-1).copy_(buffer.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
  };
}

// Builds `variant`'s model from `construct` (deferred with --deferred-init), fully_shard-ed
// block by block and at the root when `options` is set; returns the root's handle then.
template <typename Construct>
std::optional<hp::FSDPModule> build_model(Variant& variant, Construct construct,
                                          const std::optional<hp::FullyShardOptions>& options,
                                          const Options& o, c10::Device device, ModelSizes& sizes) {
  auto model = std::make_shared<decltype(construct())>(
      o.deferred_init ? hp::deferred_init(construct) : construct());
  if (sizes.params < 0) {
    sizes.params = 0;
    for (const auto& p : (*model)->parameters()) sizes.params += p.numel();
    sizes.block_params = 0;
    if (!(*model)->layers.empty()) {
      for (const auto& p : (*model)->layers.front()->parameters()) sizes.block_params += p.numel();
    }
  }
  std::optional<hp::FSDPModule> root;
  if (options) {
    for (auto& layer : (*model)->layers) hp::fully_shard(layer, *options);
    root = hp::fully_shard(*model, *options);
  }
  if (o.deferred_init) hp::materialize(**model);
  // fully_shard moved the sharded ones to the World's device; the plain ones go there.
  if (!options) (*model)->to(device);
  variant.module = model->ptr();
  variant.forward = [model](const at::Tensor& x) { return (*model)(x); };
  return root;
}

// A variant from its spec, kind[:flag+flag] (see the top of this file).
std::unique_ptr<Variant> build_variant(const std::string& spec, const Options& o,
                                       const Setting& setting, ModelSizes& sizes) {
  auto variant = std::make_unique<Variant>();
  variant->name = spec;
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const std::vector<std::string> flags =
      colon == std::string::npos ? std::vector<std::string>{} : split(spec.substr(colon + 1), '+');
  auto has = [&](const char* flag) {
    return std::find(flags.begin(), flags.end(), flag) != flags.end();
  };
  if (kind != "local" && kind != "ddp" && kind != "hp" && kind != "comm") {
    throw std::invalid_argument("unknown variant " + spec);
  }

  hp::CommPolicy policy;
  policy.error_feedback = has("ef");
  for (const char* codec : {"int8", "fp8"}) {
    if (has((std::string(codec) + "ag").c_str()))
      policy.all_gather_codec = hp::parse_comm_codec(codec);
    if (has((std::string(codec) + "rs").c_str())) {
      policy.reduce_scatter_codec = hp::parse_comm_codec(codec);
    }
  }
  std::optional<hp::FullyShardOptions> options;
  if (kind == "hp") {
    options.emplace();
    options->mesh = setting.mesh;
    options->comm_fusion = has("fusion");
    if (has("bucket")) options->comm_fusion_bucket_bytes = 128 * 1024;
    if (has("keep")) options->reshard_after_forward = false;
    if (has("raf2")) options->reshard_after_forward = int64_t{2};
    options->comm_policy = policy;
  }
  torch::manual_seed(0);  // the same initial model for every variant and rank
  std::optional<hp::FSDPModule> root =
      o.model == "transformer"
          ? build_model(
                *variant,
                [&] { return hp::Sharded<hp::models::Transformer>(transformer_config(o)); },
                options, o, setting.device(), sizes)
          : build_model(
                *variant, [&] { return hp::Sharded<Tiny>(o.tiny_blocks, o.tiny_width); }, options,
                o, setting.device(), sizes);
  if (root && has("nopf")) root->set_implicit_prefetch(false);
  if (kind == "comm") {
    variant->comm_step = comm_only_step(*variant->module, setting.mesh, !has("keep"), has("gloo"),
                                        has("fusion"), policy);
  }
  if (kind == "ddp") {
    variant->after_backward = ddp_all_reduce(variant->module->parameters(), setting.all());
  }
  const torch::optim::AdamWOptions adamw(1e-3);
  variant->optimizer =
      has("fusedopt") ? std::make_unique<hp::FusedAdamW>(variant->module->parameters(), adamw)
                      : std::make_unique<torch::optim::AdamW>(variant->module->parameters(), adamw);
  return variant;
}

// ---- Steps -----------------------------------------------------------------------------

// Deterministic per step and rank; the same batch for every variant.
std::pair<at::Tensor, at::Tensor> batch_for(int64_t step, const Options& o,
                                            const Setting& setting) {
  at::Generator gen = at::detail::createCPUGenerator(1000 * step + setting.rank);
  if (o.model == "transformer") {
    at::Tensor tokens =
        torch::randint(o.vocab, {o.batch, o.seq + 1}, gen, torch::kLong).to(setting.device());
    return {tokens.narrow(1, 0, o.seq), tokens.narrow(1, 1, o.seq)};
  }
  return {torch::randn({o.batch, o.tiny_width}, gen).to(setting.device()), at::Tensor()};
}

// One step of `v`: {forward, backward, optimizer, step} in ms. Phases end when the device
// has run them (a no-op on the CPU). `last`: also records the RSS at the forward/backward
// boundary and the loss (untimed).
std::array<double, 4> time_step(Variant& v, const at::Tensor& x, const at::Tensor& y, bool last,
                                const Options& o, c10::Device device) {
  if (v.comm_step) {
    const std::array<double, 2> t = v.comm_step();
    return {t[0], t[1], 0.0, t[0] + t[1]};
  }
  const auto synchronized_now = [cuda = device.is_cuda()] {
    if (cuda) torch::cuda::synchronize();
    return Clock::now();
  };
  const auto t0 = synchronized_now();
  v.optimizer->zero_grad();
  at::Tensor out = v.forward(x);
  at::Tensor loss =
      y.defined() ? torch::nn::functional::cross_entropy(out.reshape({-1, o.vocab}), y.reshape(-1))
                  : out.pow(2).mean();
  const auto t1 = synchronized_now();
  if (last) {
    v.boundary_rss_mib = status_mib("VmRSS");
    v.last_loss = loss.item<double>();
  }
  const auto t1b = Clock::now();
  loss.backward();
  if (v.after_backward) v.after_backward();
  const auto t2 = synchronized_now();
  v.optimizer->step();
  const auto t3 = synchronized_now();
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  return {ms(t0, t1), ms(t1b, t2), ms(t2, t3), ms(t0, t3) - ms(t1, t1b)};
}

// Steps every variant in rotation, so that no variant always runs right after another;
// records each timed step's phases, as slow as the slowest rank.
void time_variants(std::vector<std::unique_ptr<Variant>>& variants, const Options& o,
                   const Setting& setting) {
  const size_t n = variants.size();
  const int64_t last_step = o.warmup + o.steps - 1;
  for (int64_t step = 0; step <= last_step; ++step) {
    auto [x, y] = batch_for(step, o, setting);
    for (size_t k = 0; k < n; ++k) {
      Variant& v = *variants[(step + k) % n];
      hp::barrier(setting.all()).wait();
      const bool traced = !o.trace_dir.empty() && step == last_step && v.name.starts_with("hp");
      if (traced) hp::trace::start(setting.device());
      const double cpu_before = process_cpu_ms();
      const int64_t sent_before = hp::wire_bytes().total();
      const std::array<double, 4> t = time_step(v, x, y, step == last_step, o, setting.device());
      const double cpu = process_cpu_ms() - cpu_before;
      if (step >= o.warmup) v.wire_bytes += hp::wire_bytes().total() - sent_before;
      if (traced) write_trace(o, v.name, setting.rank, hp::trace::stop());
      at::Tensor times = torch::tensor({t[0], t[1], t[2], t[3], cpu}, torch::kDouble);
      hp::all_reduce(times, hp::ReduceOp::kMax, setting.all()).wait();
      if (step >= o.warmup) {
        auto a = times.accessor<double, 1>();
        v.times.push_back({a[0], a[1], a[2], a[3], a[4]});
      }
    }
  }
}

// One more step of each variant, counting the bytes it copies.
void count_copies(std::vector<std::unique_ptr<Variant>>& variants, const Options& o,
                  const Setting& setting) {
  auto [x, y] = batch_for(o.warmup + o.steps, o, setting);
  const at::CallbackHandle handle = at::addGlobalCallback(
      at::RecordFunctionCallback(count_copy).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  for (auto& v : variants) {
    hp::barrier(setting.all()).wait();
    g_copied_bytes = 0;
    g_copied_bytes_comm = 0;
    time_step(*v, x, y, /*last=*/false, o, setting.device());
    hp::barrier(setting.all()).wait();  // Gloo threads of this step are done
    v->copied_bytes = g_copied_bytes.load();
    v->copied_bytes_comm = g_copied_bytes_comm.load();
  }
  at::removeCallback(handle);
}

// ---- Results ---------------------------------------------------------------------------

nlohmann::json transformer_json(const Options& o) {
  return {{"dim", o.dim},     {"layers", o.layers}, {"heads", o.heads}, {"vocab", o.vocab},
          {"ffn", 4 * o.dim}, {"seq", o.seq},       {"batch", o.batch}};
}

// Rank 0 prints one RESULT line per variant; every rank contributes its RSS.
void print_results(const std::vector<std::unique_ptr<Variant>>& variants, const Options& o,
                   const Setting& setting, const ModelSizes& sizes, double base_rss) {
  // Per rank: peak, baseline, then each variant's RSS at its forward/backward boundary.
  std::vector<double> mine = {status_mib("VmHWM"), base_rss};
  for (const auto& v : variants) mine.push_back(v->boundary_rss_mib);
  const int64_t columns = static_cast<int64_t>(mine.size());
  at::Tensor all_rss = torch::empty({setting.ranks, columns}, torch::kDouble);
  hp::all_gather(all_rss, torch::tensor(mine, torch::kDouble), setting.all()).wait();
  if (setting.rank != 0) return;
  rlimit data_limit{};
  getrlimit(RLIMIT_DATA, &data_limit);
  const nlohmann::json limit_mib =
      data_limit.rlim_cur == RLIM_INFINITY
          ? nlohmann::json(nullptr)
          : nlohmann::json(rounded(static_cast<double>(data_limit.rlim_cur) / (1024.0 * 1024.0)));
  const auto per_rank = [&](int64_t column) {
    nlohmann::json values = nlohmann::json::array();
    for (int64_t r = 0; r < setting.ranks; ++r) {
      values.push_back(rounded(all_rss[r][column].item<double>()));
    }
    return values;
  };
  for (int64_t index = 0; index < static_cast<int64_t>(variants.size()); ++index) {
    const Variant& v = *variants[index];
    int64_t local_numel = 0;
    for (const auto& p : v.module->parameters()) local_numel += p.numel();
    nlohmann::json result = {
        {"impl", v.name.starts_with("hp") ? "hp" : "cpp"},
        {"variant", v.name},
        {"label", o.label},
        {"world", setting.ranks},
        {"mesh", std::to_string(setting.replicate) + "x" + std::to_string(setting.shard)},
        {"steps", v.times.size()},
        {"warmup", o.warmup},
        {"error", nullptr},
        {"copied_bytes", v.copied_bytes},
        {"copied_bytes_comm", v.copied_bytes_comm},
        {"local_params", local_numel},
    };
    if (o.model == "transformer") {
      result["model"] = transformer_json(o);
    }
    result["params"] = sizes.params;
    result["block_params"] = sizes.block_params;
    result["deferred_init"] = o.deferred_init;
    result["rlimit_data_mib"] = limit_mib;
    result["loss"] = rounded(v.last_loss);
    result["wire_bytes_per_step"] =
        v.times.empty() ? 0 : v.wire_bytes / static_cast<int64_t>(v.times.size());
    result["peak_rss_mib"] = per_rank(0);
    result["base_rss_mib"] = per_rank(1);
    result["boundary_rss_mib"] = per_rank(2 + index);
    const char* keys[] = {"fwd", "bwd", "opt", "step", "cpu"};
    for (int c = 0; c < 5; ++c) {
      std::vector<double> column;
      for (const auto& t : v.times) column.push_back(t[c]);
      result[std::string(keys[c]) + "_ms"] = rounded(quantile(column, 0.5));
      // The spread of the step time shows how noisy the machine was.
      if (c == 3) {
        result["step_p25_ms"] = rounded(quantile(column, 0.25));
        result["step_p75_ms"] = rounded(quantile(column, 0.75));
      }
    }
    std::printf("RESULT %s\n", result.dump().c_str());
  }
  std::fflush(stdout);
}

// ---- Checkpoint saves ------------------------------------------------------------------

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Each value's maximum over the ranks (one all-reduce).
std::vector<double> max_over_ranks(const std::vector<double>& values, const hp::Group& all) {
  at::Tensor t = torch::tensor(values, torch::kDouble);
  hp::all_reduce(t, hp::ReduceOp::kMax, all).wait();
  return {t.data_ptr<double>(), t.data_ptr<double>() + t.numel()};
}

nlohmann::json mean_ms(const std::vector<double>& v) {
  if (v.empty()) return nullptr;
  return rounded(std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()));
}

nlohmann::json each_ms(const std::vector<double>& v) {
  nlohmann::json out = nlohmann::json::array();
  for (double x : v) out.push_back(rounded(x));
  return out;
}

// Minor page faults of this process so far (the copy-on-write copies of a forked save
// are among them).
double minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_minflt);
}

const char* staging_name(hp::CheckpointStaging staging) {
  return staging == hp::CheckpointStaging::kFork ? "fork" : "copy";
}

// --checkpoint: the `hp` model (AdamW) trains `warmup` steps, then
//   1. `steps` steps without saving;
//   2. `saves` times a step, then save_sharded_checkpoint: the time it blocks training;
//   then, for each staging of AsyncCheckpointSaver (kFork, then kCopy, the default), with
//   a saver of its own:
//   3. `saves` times a step, then save() (it blocks while it takes the snapshot: the fork
//      of a writer process, or the copy of this rank's pieces into staging memory), then
//      training goes on until the write is complete on every rank: the write's duration
//      from save() on (a watcher thread notes its end to the millisecond), the time of
//      the steps that started while it was in flight, and this process's minor page
//      faults from save() to the end of the write (a forked save's copy-on-write copies);
//   4. `saves` times a step, then save() and wait() at once: the write alone.
// The step time without saving is the mean of the steps of 1. and of the step before each
// save (no write in flight then): they sample the machine's load over the whole run, as
// the steps during the writes do; their page faults per step are the baseline of 3.'s.
// 2. and 3. save once more first, left out of the means: the first async save also makes
// the writer's process group (and, kCopy, allocates the staging memory) (reported apart).
// Times are the slowest rank's (each phase starts at a barrier); rank 0's blocked times too.
int run_checkpoint(const Options& o, const Setting& setting) {
  if (o.model != "transformer") throw std::invalid_argument("--checkpoint needs the transformer");
  ModelSizes sizes;
  const std::unique_ptr<Variant> v = build_variant("hp", o, setting, sizes);
  const hp::Group& all = setting.all();
  int64_t step = 0;
  const auto train = [&] {
    auto [x, y] = batch_for(step++, o, setting);
    hp::barrier(all).wait();
    return max_over_ranks({time_step(*v, x, y, false, o, setting.device())[3]}, all)[0];
  };
  // A step with no write in flight, its page faults counted.
  std::vector<double> plain, plain_faults;
  const auto train_plain = [&] {
    const double before = minor_faults();
    plain.push_back(train());
    plain_faults.push_back(minor_faults() - before);
  };
  const std::filesystem::path root = o.checkpoint_dir;
  double checkpoint_mib = 0;
  // Rank 0 measures a finished checkpoint and removes it, so the disk holds one at a time.
  const auto discard = [&](const std::filesystem::path& dir) {
    hp::barrier(all).wait();
    if (setting.rank != 0) return;
    checkpoint_mib = 0;
    for (const auto& file : std::filesystem::recursive_directory_iterator(dir)) {
      if (file.is_regular_file())
        checkpoint_mib += static_cast<double>(file.file_size()) / 1048576.0;
    }
    std::filesystem::remove_all(dir);
  };

  for (int64_t i = 0; i < o.warmup; ++i) train();
  for (int64_t i = 0; i < o.steps; ++i) train_plain();

  std::vector<double> sync_max, sync_rank0;
  double sync_first = 0;
  for (int64_t k = 0; k <= o.saves; ++k) {
    train_plain();
    const std::filesystem::path dir = root / ("sync-" + std::to_string(k));
    hp::barrier(all).wait();
    const auto start = Clock::now();
    hp::save_sharded_checkpoint(dir.string(), *v->module, v->optimizer.get());
    const double mine = ms_since(start);
    const double slowest = max_over_ranks({mine}, all)[0];
    if (k == 0) {
      sync_first = slowest;
    } else {
      sync_max.push_back(slowest);
      sync_rank0.push_back(mine);
    }
    discard(dir);
  }

  // 3. and 4. for one staging, with a saver of its own (freed after: kCopy's staging memory
  // does not stay in the process).
  const auto measure_async = [&](hp::CheckpointStaging staging) {
    const std::string name = staging_name(staging);
    hp::AsyncCheckpointSaver saver(staging);
    std::vector<double> blocked_max, blocked_rank0, write_max, during, faults_max, rss_max;
    double first_blocked = 0;
    for (int64_t k = 0; k <= o.saves; ++k) {
      train_plain();
      const std::filesystem::path dir = root / (name + "-" + std::to_string(k));
      const double rss = status_mib("VmRSS");
      hp::barrier(all).wait();
      const double faults_before = minor_faults();
      const auto start = Clock::now();
      saver.save(dir.string(), *v->module, v->optimizer.get());
      const double blocked = ms_since(start);
      Clock::time_point written;
      std::thread watcher([&] {
        while (saver.busy()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        written = Clock::now();
      });
      // Steps start while the write is in flight on any rank.
      while (max_over_ranks({saver.busy() ? 1.0 : 0.0}, all)[0] > 0) {
        const double ms = train();
        if (k > 0) during.push_back(ms);
      }
      watcher.join();
      saver.wait();  // throws when the write failed
      const double faults = minor_faults() - faults_before;
      const std::vector<double> slowest = max_over_ranks(
          {blocked, std::chrono::duration<double, std::milli>(written - start).count(), faults,
           rss},
          all);
      if (k == 0) {
        first_blocked = slowest[0];
      } else {
        blocked_max.push_back(slowest[0]);
        blocked_rank0.push_back(blocked);
        write_max.push_back(slowest[1]);
        faults_max.push_back(slowest[2]);
        rss_max.push_back(slowest[3]);
      }
      discard(dir);
    }
    // The same write with nothing running beside it: save() and wait() at once.
    std::vector<double> alone_max;
    for (int64_t k = 1; k <= o.saves; ++k) {
      train_plain();
      const std::filesystem::path dir = root / (name + "-alone-" + std::to_string(k));
      hp::barrier(all).wait();
      const auto start = Clock::now();
      saver.save(dir.string(), *v->module, v->optimizer.get());
      saver.wait();
      alone_max.push_back(max_over_ranks({ms_since(start)}, all)[0]);
      discard(dir);
    }
    return nlohmann::json{
        {"blocked_ms", mean_ms(blocked_max)},
        {"blocked_rank0_ms", mean_ms(blocked_rank0)},
        {"blocked_each_ms", each_ms(blocked_max)},
        {"first_blocked_ms", rounded(first_blocked)},
        {"write_ms", mean_ms(write_max)},
        {"write_each_ms", each_ms(write_max)},
        {"alone_ms", mean_ms(alone_max)},
        {"alone_each_ms", each_ms(alone_max)},
        {"during_write_step_ms", mean_ms(during)},
        {"during_write_each_ms", each_ms(during)},
        {"during_write_steps", during.size()},
        {"write_faults", mean_ms(faults_max)},  // per save, slowest rank: a count, not ms
        {"rss_mib", mean_ms(rss_max)},
    };
  };
  nlohmann::json async;
  for (hp::CheckpointStaging staging :
       {hp::CheckpointStaging::kFork, hp::CheckpointStaging::kCopy}) {
    async[staging_name(staging)] = measure_async(staging);
  }
  // Page faults of a step with no write in flight, the slowest rank's mean.
  const double faults_per_step =
      max_over_ranks({std::accumulate(plain_faults.begin(), plain_faults.end(), 0.0) /
                      static_cast<double>(plain_faults.size())},
                     all)[0];
  if (setting.rank == 0) {
    std::error_code ignored;  // only when empty: DIR may hold other files
    std::filesystem::remove(root, ignored);
    const nlohmann::json result = {
        {"impl", "hp"},
        {"variant", "checkpoint"},
        {"label", o.label},
        {"world", setting.ranks},
        {"mesh", std::to_string(setting.replicate) + "x" + std::to_string(setting.shard)},
        {"error", nullptr},
        {"model", transformer_json(o)},
        {"params", sizes.params},
        {"deferred_init", o.deferred_init},
        {"warmup", o.warmup},
        {"steps", plain.size()},
        {"plain_steps", o.steps},
        {"saves", o.saves},
        {"checkpoint_mib", rounded(checkpoint_mib)},
        {"page_kib", static_cast<double>(sysconf(_SC_PAGESIZE)) / 1024.0},
        {"step_ms", mean_ms(plain)},
        {"step_each_ms", each_ms(plain)},
        {"step_faults", rounded(faults_per_step)},
        {"sync_blocked_ms", mean_ms(sync_max)},
        {"sync_blocked_rank0_ms", mean_ms(sync_rank0)},
        {"sync_each_ms", each_ms(sync_max)},
        {"sync_first_ms", rounded(sync_first)},
        {"async", async},  // per staging: "fork" (the default), "copy"
    };
    std::printf("RESULT %s\n", result.dump().c_str());
    std::fflush(stdout);
  }
  hp::barrier(all).wait();
  return 0;
}

// ---- The run ---------------------------------------------------------------------------

int run(const Options& o) {
  const Setting setting = make_setting(o);
  if (!o.checkpoint_dir.empty()) return run_checkpoint(o, setting);
  // The process before any model exists (LibTorch, Gloo, the world): peak RSS minus this
  // is what the variant's model, optimizer and steps cost.
  const double base_rss = status_mib("VmRSS");
  ModelSizes sizes;
  std::vector<std::unique_ptr<Variant>> variants;
  for (const std::string& spec : split(o.variants, ',')) {
    variants.push_back(build_variant(spec, o, setting, sizes));
  }
  time_variants(variants, o, setting);
  if (o.count_copies) count_copies(variants, o, setting);
  print_results(variants, o, setting, sizes, base_rss);
  hp::barrier(setting.all()).wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  g_main_thread = std::this_thread::get_id();
  at::set_num_threads(1);  // ranks share the machine's cores
  try {
    return run(parse_args(argc, argv));
  } catch (const c10::Error& error) {  // one line, not LibTorch's C++ backtrace
    std::fprintf(stderr, "hp_bench: error: %s\n", error.what_without_backtrace());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "hp_bench: error: %s\n", error.what());
    return 1;
  }
}
