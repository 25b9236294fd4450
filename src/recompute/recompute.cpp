#include "hyperparallel/recompute.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <memory>
#include <sstream>

#include "../deferred_init/rng_snapshot.h"
#include "recompute_scope.h"
#include "saved_tensor_hooks.h"

namespace hp {
namespace {

using torch::autograd::SavedVariableHooks;
using torch::autograd::variable_list;

// What the forward saved of a tensor: enough to check the rerun's, cheap to record.
struct SavedMeta {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  c10::Device device;

  explicit SavedMeta(const at::Tensor& t)
      : sizes(t.sizes().vec()), dtype(t.scalar_type()), device(t.device()) {}
  bool operator==(const SavedMeta&) const = default;
  std::string str() const {
    std::ostringstream out;
    out << c10::IntArrayRef(sizes) << " " << dtype << " on " << device;
    return out.str();
  }
};

// --- non-reentrant: saved-tensor hooks --------------------------------------------

// An input the rerun needs, kept as a tensor saved for backward is kept at this point: by
// the saved-tensor hooks around the region (activation swap moves it off the device, an
// enclosing recompute drops it), or as it is where there are none. PyTorch's
// non-reentrant checkpoint saves its inputs the same way.
class KeptInput {
 public:
  explicit KeptInput(const at::Tensor& input)
      : requires_grad_(input.defined() && input.requires_grad()) {
    if (input.defined()) {
      hooks_ = torch::autograd::Engine::get_default_engine().get_default_saved_variable_hooks();
    }
    if (!hooks_) {
      tensor_ = input;
      return;
    }
    at::NoGradGuard no_grad;  // as autograd packs
    hooks_->call_pack_hook(input);
  }

  at::Tensor get() {
    if (!hooks_) return tensor_;
    // Requiring grad as it did, the rerun saves what the forward saved.
    at::Tensor value = hooks_->call_unpack_hook();
    return requires_grad_ ? value.detach().requires_grad_() : value;
  }

 private:
  bool requires_grad_;
  std::unique_ptr<SavedVariableHooks> hooks_;
  at::Tensor tensor_;
};

class Region;

// Thrown by the hook that collects a rerun's last needed tensor, caught by that rerun: it
// ends the rerun early. Not a std::exception, so that the region's own handlers of errors
// let it pass.
struct RerunComplete {
  const Region* region;
};

// One run of a region: what its forward saved (its metadata, not the tensors) and, after a
// rerun, the tensors backward has not taken yet.
class Region : public std::enable_shared_from_this<Region> {
 public:
  Region(RecomputeFn fn, const std::vector<at::Tensor>& inputs,
         std::optional<detail::RngSnapshot> rng, bool early_stop)
      : fn_(std::move(fn)), rng_(std::move(rng)), early_stop_(early_stop) {
    for (const auto& input : inputs) inputs_.emplace_back(input);
  }

  size_t note_saved(const at::Tensor& t) {
    saved_.emplace_back(t);
    return saved_.size() - 1;
  }

  at::Tensor take(size_t index) {
    // Not there: never recomputed, or taken already by an earlier backward through a
    // retained graph; either way a rerun provides it.
    if (index >= recomputed_.size() || !recomputed_[index].defined()) recompute();
    return std::move(recomputed_[index]);
  }

 private:
  // Catches the tensors the rerun saves, in the order the forward saved them.
  class Collect final : public SavedVariableHooks {
   public:
    explicit Collect(Region& region) : region_(region) {}
    void call_pack_hook(const at::Tensor& t) override { region_.collect(t); }
    at::Tensor call_unpack_hook() override {
      C10_THROW_ERROR(Error, "recompute: the graph of a recompute is never backpropagated");
    }

   private:
    Region& region_;
  };

  void collect(const at::Tensor& t) {
    if (stop_thrown_) throw_stop_swallowed();
    if (collected_ >= saved_.size() || !(SavedMeta(t) == saved_[collected_])) {
      std::ostringstream what;
      what << "recompute: the recomputed region saved ";
      if (collected_ >= saved_.size()) {
        what << "more tensors for backward than its forward (" << saved_.size() << ")";
      } else {
        what << "tensor #" << collected_ << " as " << SavedMeta(t).str()
             << " where its forward saved " << saved_[collected_].str();
      }
      what << ". A recomputed function must compute the same thing when rerun: same "
              "inputs, no module state changed between forward and backward, random "
              "draws reproduced (preserve_rng_state).";
      C10_THROW_ERROR(Error, what.str());
    }
    recomputed_[collected_++] = t.detach();
    if (early_stop_ && collected_ == saved_.size()) {
      stop_thrown_ = true;
      throw RerunComplete{this};
    }
  }

  [[noreturn]] static void throw_stop_swallowed() {
    C10_THROW_ERROR(Error,
                    "recompute: the recomputed region caught the exception that ends its rerun "
                    "once every tensor backward needs is recomputed (early stop), and went on; "
                    "let exceptions the region does not know pass (rethrow in catch (...)), or "
                    "set RecomputeOptions::early_stop = false");
  }

  void recompute() {
    std::vector<at::Tensor> inputs;
    for (auto& input : inputs_) inputs.push_back(input.get());
    recomputed_.assign(saved_.size(), at::Tensor());
    collected_ = 0;
    stop_thrown_ = false;
    bool stopped = false;
    {
      detail::SavedTensorHooksScope hooks([this] { return std::make_unique<Collect>(*this); });
      detail::SavedTensorRecomputeScope fully_shard_sees_a_rerun;
      at::AutoGradMode grad(true);
      std::optional<detail::RngReplayScope> replay;
      if (rng_) replay.emplace(*rng_);
      try {
        fn_(inputs);
      } catch (const RerunComplete& stop) {
        if (stop.region != this) throw;
        stopped = true;
      }
    }
    if (stop_thrown_ && !stopped) throw_stop_swallowed();
    if (collected_ != saved_.size()) {
      C10_THROW_ERROR(Error, "recompute: the recomputed region saved " +
                                 std::to_string(collected_) +
                                 " tensors for backward where its forward saved " +
                                 std::to_string(saved_.size()) +
                                 ". A recomputed function must compute the same thing when rerun.");
    }
  }

  RecomputeFn fn_;
  std::vector<KeptInput> inputs_;
  std::optional<detail::RngSnapshot> rng_;
  std::vector<SavedMeta> saved_;
  std::vector<at::Tensor> recomputed_;
  size_t collected_ = 0;
  bool early_stop_;
  bool stop_thrown_ = false;  // by the current rerun
};

// Keeps nothing of a saved tensor but its place in the region's save order.
class DropAndRecompute final : public SavedVariableHooks {
 public:
  explicit DropAndRecompute(std::shared_ptr<Region> region) : region_(std::move(region)) {}
  void call_pack_hook(const at::Tensor& t) override { index_ = region_->note_saved(t); }
  at::Tensor call_unpack_hook() override { return region_->take(index_); }

 private:
  std::shared_ptr<Region> region_;
  size_t index_ = 0;
};

std::vector<at::Tensor> recompute_non_reentrant(const RecomputeFn& fn,
                                                const std::vector<at::Tensor>& inputs,
                                                const RecomputeOptions& options) {
  std::optional<detail::RngSnapshot> rng;
  if (options.preserve_rng_state) rng = detail::RngSnapshot::capture(inputs);
  auto region =
      std::make_shared<Region>(fn, inputs, std::move(rng), options.early_stop.value_or(true));
  detail::SavedTensorHooksScope hooks(
      [region] { return std::make_unique<DropAndRecompute>(region); });
  return fn(inputs);
}

// --- reentrant: an autograd function --------------------------------------------

struct ReentrantRegion : torch::CustomClassHolder {
  RecomputeFn fn;
  std::optional<detail::RngSnapshot> rng;
};

struct ReentrantRecompute : torch::autograd::Function<ReentrantRecompute> {
  static variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                               c10::intrusive_ptr<ReentrantRegion> region) {
    ctx->save_for_backward(inputs.vec());
    auto outputs = region->fn(inputs.vec());
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return outputs;
  }

  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      C10_THROW_ERROR(
          Error,
          "recompute (reentrant): gradients asked with torch::autograd::grad cannot pass "
          "a reentrant recompute; call backward(), or use RecomputeImpl::kNonReentrant");
    }
    auto holder = ctx->saved_data["region"].toCapsule();
    auto& region = *static_cast<ReentrantRegion*>(holder.get());
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables()) {
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad())
                                       : saved);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad(true);
      std::optional<detail::RngReplayScope> replay;
      if (region.rng) replay.emplace(*region.rng);
      outputs = region.fn(inputs);
    }
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list input_grads;
    for (const auto& input : inputs) {
      input_grads.push_back(input.defined() ? input.grad() : at::Tensor());
    }
    input_grads.emplace_back();  // the region argument
    return input_grads;
  }
};

std::vector<at::Tensor> recompute_reentrant(const RecomputeFn& fn,
                                            const std::vector<at::Tensor>& inputs,
                                            const RecomputeOptions& options) {
  bool any_requires_grad = false;
  for (const auto& t : inputs) any_requires_grad |= t.defined() && t.requires_grad();
  if (!any_requires_grad) {
    C10_THROW_ERROR(ValueError,
                    "recompute (reentrant): no input requires grad, so backward would never reach "
                    "the region and its parameters would get no gradient; use "
                    "RecomputeImpl::kNonReentrant, or pass an input that requires grad");
  }
  auto region = c10::make_intrusive<ReentrantRegion>();
  region->fn = fn;
  if (options.preserve_rng_state) region->rng = detail::RngSnapshot::capture(inputs);
  return ReentrantRecompute::apply(at::TensorList(inputs), std::move(region));
}

}  // namespace

std::vector<at::Tensor> recompute(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs,
                                  const RecomputeOptions& options) {
  if (!fn) C10_THROW_ERROR(ValueError, "recompute: the function is empty");
  if (options.impl == RecomputeImpl::kReentrant && options.early_stop.value_or(false)) {
    C10_THROW_ERROR(ValueError,
                    "recompute: early_stop = true needs RecomputeImpl::kNonReentrant (a reentrant "
                    "rerun is backpropagated through, so it runs whole); leave early_stop unset "
                    "or use the non-reentrant kind");
  }
  if (!c10::GradMode::is_enabled()) return fn(inputs);  // no graph, nothing to save
  switch (options.impl) {
    case RecomputeImpl::kNonReentrant:
      return recompute_non_reentrant(fn, inputs, options);
    case RecomputeImpl::kReentrant:
      return recompute_reentrant(fn, inputs, options);
  }
  C10_THROW_ERROR(ValueError, "recompute: unknown RecomputeImpl");
}

at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input, const RecomputeOptions& options) {
  if (!fn) C10_THROW_ERROR(ValueError, "recompute: the function is empty");
  // By value: the region keeps the function until backward.
  auto outputs = recompute(
      [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
      {input}, options);
  return outputs[0];
}

}  // namespace hp
