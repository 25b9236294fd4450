#pragma once
// fully_shard: FSDP (1-D mesh) and HSDP (2-D mesh: replicate, shard) for LibTorch.
//
//   hp::Sharded<Block> block(cfg);             // declare the module as Sharded<...>
//   hp::fully_shard(block, options);           // blocks first ...
//   hp::fully_shard(model, options);           // ... then the root
//   auto loss = loss_fn(model(x)); loss.backward(); optimizer.step();
//
// Between steps the module's parameters are this rank's shards (optimizers work on them
// unchanged); around each forward/backward they are swapped for the unsharded tensors.
// Forward interception needs the call to go through Sharded<M>::operator(); a module
// called around it (block->forward(x), a Sequential, a ModuleList) is reported when its
// parameters get gradients while sharded.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "hyperparallel/collectives.h"
#include "hyperparallel/comm_handle.h"
#include "hyperparallel/detail/sharded_forward.h"
#include "hyperparallel/mesh.h"
#include "hyperparallel/placement.h"
#include "hyperparallel/policy.h"

namespace hp {

namespace detail {
class FSDPState;
struct FSDPModuleAccess;
}  // namespace detail

struct FullyShardOptions {
  // Unset: a 1-D mesh over all ranks of the default world (from the environment).
  // 1-D: FSDP over it. 2-D: HSDP, dim 0 replicates, dim 1 shards.
  std::optional<DeviceMesh> mesh;
  // Unset: reshard after forward, except for the root (whose backward comes first).
  // true / false: reshard after forward or keep the unsharded parameters until backward.
  // An int k dividing the shard size: after forward keep the parameters sharded over
  // groups of k consecutive shard ranks (e.g. one node), so backward all-gathers only
  // within that group. k == 1 is true, k == shard size is false.
  std::optional<std::variant<bool, int64_t>> reshard_after_forward;
  // Per parameter (name relative to the module): Shard(dim) or Replicate(); unset
  // result or unset function: Shard(0).
  std::function<std::optional<Placement>(const std::string& name, const at::Tensor& param)>
      shard_placement_fn;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  CommPolicy comm_policy;
  // Left exactly as they are: not sharded, not reduced.
  std::vector<at::Tensor> ignored_params;
  // Kept whole on every rank; gradients all-reduced over the data-parallel ranks. The same
  // as shard_placement_fn returning Replicate() for them (and it wins over the function).
  // mp_policy holds for them as for sharded parameters; comm_policy does not.
  std::vector<at::Tensor> replicate_params;
  // One all-gather / reduce-scatter per module (with copy-in / copy-out) instead of
  // one per parameter.
  bool comm_fusion = false;
  // With comm_fusion: the fused buffer moves in collectives of whole consecutive
  // parameters sending at most this many bytes on the wire to each peer (codes and
  // scales where comm_policy quantizes), all issued at once (0: one collective per
  // module). On a TCP link a message far larger than the link's burst runs below its
  // rate; several smaller ones keep it full. Each costs a collective's latency.
  int64_t comm_fusion_bucket_bytes = 0;
};

// Where a sharded parameter lives: global shape, placement on the shard dimension.
struct ShardedParamInfo {
  std::string name;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> local_shape;
  Placement placement = Placement::shard(0);
  std::vector<std::string> mesh_dims;  // (replicate,) shard
};

// The interface of a fully_shard-ed module. Cheap to copy; all copies act on the same
// module state.
class FSDPModule {
 public:
  // All-gathers the parameters (now, or asynchronously: wait() on the handle before
  // using them). A second call while unsharded or pending returns the same state.
  CommHandle unshard(bool async_op = false);
  void reshard();
  bool is_unsharded() const;

  // recurse: apply to every fully_shard-ed module in this module's subtree too.
  void set_requires_gradient_sync(bool value, bool recurse = true);
  void set_requires_all_reduce(bool value, bool recurse = true);
  void set_reshard_after_forward(bool value, bool recurse = true);
  void set_reshard_after_backward(bool value, bool recurse = true);
  // Whether this backward is the last before the optimizer step (default true): false
  // leaves the gradient reductions in flight, finished by the next forward or zero_grad.
  // On the root only, like set_implicit_prefetch: on another module, or on one that
  // turns out not to be the root at the first forward, it is an error (c10::Error).
  void set_is_last_backward(bool value);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  // Modules without explicit prefetch lists prefetch implicitly (default on): in
  // forward the module that followed them in the previous iteration, in backward the
  // one that preceded them in this iteration's forward. On the root only.
  void set_implicit_prefetch(bool value);
  // ReduceOp::kAvg (default: divide by the data-parallel size) or ReduceOp::kSum.
  void set_reduce_op_type(ReduceOp op);
  // Divide reduced gradients by this instead (overrides the reduce op's division).
  void set_gradient_divide_factor(double factor);
  // Clears sharded gradients, fp32 main grads and gradients kept for accumulation.
  void zero_grad();
  // CommPolicy::error_feedback, over this module's subtree: the gradient blocks whose
  // residual was dropped, since the start or the last reset (a block holding an inf or a
  // NaN cannot be carried, so its residual starts again from zero; a collective carries
  // such a block as NaNs). Reads a counter on the device.
  int64_t error_feedback_blocks_dropped() const;
  // Every residual of the subtree back to zeros, and the count with them (e.g. after a
  // step skipped for a non-finite gradient). c10::ValueError when no module of the
  // subtree has error feedback.
  void reset_error_feedback();

  std::vector<ShardedParamInfo> sharded_params() const;
  // The whole parameter, gathered from all shards, and from all tensor-parallel slices
  // for a parameter of a tensor-parallel layer (a collective: call on every rank).
  at::Tensor full_tensor(const std::string& name) const;
  // The whole gradient of a parameter, gathered as full_tensor gathers (a collective);
  // undefined when the parameter has no gradient on any rank.
  at::Tensor full_grad(const std::string& name) const;
  // apply_grad_on_fp32_main_grad: the fp32 gradient accumulator of a parameter.
  at::Tensor main_grad(const std::string& name) const;

 private:
  friend struct detail::FSDPModuleAccess;  // fully_shard() makes them
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state);
  std::shared_ptr<detail::FSDPState> state_;
};

// A module holder whose calls run fully_shard's forward hooks (once fully_shard-ed;
// before that it behaves exactly like Holder).
template <typename Holder>
class Sharded : public Holder {
 public:
  using Holder::Holder;
  Sharded(Holder holder) : Holder(std::move(holder)) {}  // NOLINT: implicit on purpose

  template <typename... Args>
  auto operator()(Args&&... args) {
    using Output =
        std::decay_t<decltype(this->get()->forward(std::declval<std::decay_t<Args>&>()...))>;
    static_assert(detail::tensors_are_visible<Output>(),
                  "hp::Sharded: the module's forward must return at::Tensor, or std::vector, "
                  "std::tuple, std::pair or std::optional of those (nested; numbers, enums and "
                  "std::string may sit beside them). Tensors in other types (structs, maps, "
                  "arrays, IValue) get no pre-backward hook, so backward would run on sharded "
                  "parameters");
    detail::ForwardHooks hooks(this->ptr().get());
    if (!hooks.active()) return Holder::operator()(std::forward<Args>(args)...);
    std::tuple<std::decay_t<Args>...> inputs(std::forward<Args>(args)...);
    std::vector<at::Tensor*> input_tensors;
    detail::collect_tensors(inputs, input_tensors);
    hooks.before(input_tensors);
    auto output = std::apply([this](auto&... a) { return this->get()->forward(a...); }, inputs);
    std::vector<at::Tensor*> output_tensors;
    detail::collect_tensors(output, output_tensors);
    hooks.after(output_tensors);
    return output;
  }

  // The fully_shard interface of this module; throws if it was not fully_shard-ed.
  FSDPModule fsdp() const;
};

// A reference to any Sharded<...> module, for fully_shard.
class ShardableModule {
 public:
  template <typename Holder>
  ShardableModule(Sharded<Holder>& module)  // NOLINT: implicit on purpose
      : module_(module.ptr()) {}
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
};

// Shards the parameters of `module` that no fully_shard-ed submodule manages.
FSDPModule fully_shard(ShardableModule module, FullyShardOptions options = {});
// One state for several modules (they unshard and reduce together); returns each
// module's interface.
std::vector<FSDPModule> fully_shard(const std::vector<ShardableModule>& modules,
                                    FullyShardOptions options = {});

template <typename Holder>
FSDPModule Sharded<Holder>::fsdp() const {
  return detail::fsdp_module_of(this->ptr().get());
}

}  // namespace hp
