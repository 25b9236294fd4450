#pragma once
// One sharded parameter: its padded local shard, the unsharded tensor installed for
// forward/backward, and its gradient on the way from unsharded to sharded.
//
// The registered parameter variable keeps its identity throughout (module members,
// parameters() and optimizer state all refer to it); only its data is swapped with
// set_data between the local shard and the unsharded tensor.

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/placement.h"

namespace hp {
class Group;
}

namespace hp::detail {

struct ParamPolicy {
  std::optional<c10::ScalarType> param_dtype;   // unsharded dtype; unset: the parameter's own
  std::optional<c10::ScalarType> reduce_dtype;  // unset: the unsharded gradient's dtype
  bool fp32_main_grad = false;
  bool offload = false;  // keep the shard and its gradient in host memory
  bool pin_memory = false;
  // The mesh's device (World::device()): a parameter on the CPU computes there when it is
  // a GPU, as FSDP2 moves a module's states to its mesh's device.
  c10::Device mesh_device = c10::Device(c10::DeviceType::CPU);
  // Whether unsharding all-gathers (Group::communicates(), also for one shard rank).
  bool shard_group_communicates = false;
  // Meta parameters stay meta until the front-end moves them (module.to_empty() and
  // move_shard), instead of being hp::deferred_init's to materialize.
  bool meta_moved_by_front_end = false;
};

// Where dim `dim` of `global_shape` is cut into `shards` chunks of `chunk` entries; this
// rank holds `local` of them (the last ranks may hold fewer, or none: padding).
struct ShardLayout {
  std::vector<int64_t> global_shape;
  int64_t dim = 0;
  int64_t shards = 1;  // the shard group's size
  int64_t rank = 0;
  int64_t chunk = 0;
  int64_t local = 0;
  std::vector<int64_t> padded_local_shape;  // global shape with dim -> chunk
  int64_t padded_numel = 0;

  ShardLayout(std::vector<int64_t> shape, int64_t shard_dim, int64_t shard_count,
              int64_t rank_in_group);
  std::vector<int64_t> local_shape() const;
  // Where this rank's part starts along `dim` (its `local` entries follow).
  int64_t start() const;
  // Entries of rank r's chunk along `dim` (fewer for the last ranks, 0 for padding).
  int64_t length_of(int64_t r) const;
  // Copies a rank-major [shards x padded_numel] gather into `full` (global shape).
  void copy_from_rank_major(const at::Tensor& rank_major, const at::Tensor& full) const;
  // Copies the chunks of ranks [first, first + count) of `full` into `rank_major`
  // ([count x padded_numel]); its padding is left untouched.
  void copy_to_rank_major(const at::Tensor& full, const at::Tensor& rank_major, int64_t first,
                          int64_t count) const;
};

// A tensor handed to a collective, and whether this library allocated it for that (then
// it is freed once the collective is done with it). A view of the caller's gradient, or
// the shard itself, is never freed here.
struct CommBuffer {
  at::Tensor tensor;
  bool owned = false;
};

class FSDPParam {
 public:
  FSDPParam(std::string name, at::Tensor variable, int64_t shard_dim, int64_t shard_count,
            int64_t shard_rank, ParamPolicy policy);

  const std::string& name() const { return name_; }
  const at::Tensor& variable() const { return variable_; }
  const ShardLayout& layout() const { return layout_; }
  c10::ScalarType orig_dtype() const { return orig_dtype_; }
  c10::ScalarType param_dtype() const { return param_dtype_; }
  bool requires_grad() const { return variable_.requires_grad(); }
  bool offloads() const { return policy_.offload; }

  // --- unshard / reshard -------------------------------------------------------
  // The unsharded parameter is one tensor for the parameter's whole life (in param
  // dtype, on the compute device). Resharding frees its storage; the next unshard
  // allocates the same storage again and refills it, so views of it that autograd saved
  // in forward read the refilled data in backward.
  //
  // The padded shard in param dtype, on the compute device: the all-gather input (the
  // shard itself when no cast or move is needed).
  CommBuffer all_gather_input() const;
  // Where a [shards x padded_numel] rank-major all-gather of this parameter should land:
  // the unsharded storage itself for Shard(0) (allocated now), so that no copy-out is
  // needed; a new buffer otherwise. `gathers_in_place()` tells which.
  at::Tensor all_gather_output();
  bool gathers_in_place() const { return layout_.dim == 0; }
  // Fills the unsharded storage from a rank-major all-gather result (nothing to do when
  // it is all_gather_output() of an in-place layout).
  void copy_out(const at::Tensor& rank_major);
  // Unshards without communication (a shard group of one rank): the shard itself when
  // no cast or move is needed, else a copy into the unsharded storage.
  void unshard_locally();
  // Points the variable at the unsharded tensor (filled by copy_out / unshard_locally).
  void install_unsharded();
  // Points the variable back at the shard and takes the unsharded storage's memory out
  // (empty if none): the caller frees it, now or once the device is done reading it.
  [[nodiscard]] at::DataPtr install_sharded();
  bool is_unsharded() const { return status_->unsharded; }
  // The fully_shard-ed module's path, for error messages.
  void set_owner(std::string owner) { status_->owner = std::move(owner); }
  // Ranks [index * shards / parts, (index + 1) * shards / parts) of the rank-major
  // unsharded data (a copy, [shards / parts x padded_numel]): what this rank keeps after
  // forward when resharding to a group of `parts` ranks.
  at::Tensor post_forward_part(int64_t index, int64_t parts) const;
  // Bytes the unsharded storage holds now (0 once freed, or when it aliases the shard).
  int64_t unsharded_bytes() const;
  // The padded shard in the parameter's own dtype, on the compute device.
  at::Tensor padded_shard() const { return padded_shard_.to(compute_device_); }
  // A local-shard-shaped tensor laid out as a [padded_numel] shard of `dtype`.
  at::Tensor pad_local(const at::Tensor& local, c10::ScalarType dtype) const;
  // This rank's part of a tensor shaped like the whole parameter (a view; may be empty).
  at::Tensor local_part(const at::Tensor& full) const;
  // Copies this rank's part of the whole parameter into the shard (padding stays zero).
  void load_full(const at::Tensor& full);
  // Copies this rank's part (shaped like local_shape()) into the shard.
  void load_local(const at::Tensor& local);
  // The local shard in the parameter's own dtype and shape (a view of the padded shard).
  const at::Tensor& sharded_view() const { return sharded_view_; }
  // Moves the shard to `local`'s device and dtype and takes its values (shaped as
  // local_shape()): the padded shard, the unsharded buffers and the variable follow, the
  // gradients and the error-feedback residual of the old shard are dropped. For a front-end
  // whose module was moved or cast (module.to(), to_empty() after meta-device init); only
  // while sharded.
  void move_shard(const at::Tensor& local);
  // Throws when the variable no longer holds the shard while sharded: something outside
  // fully_shard (module->to(), set_data) replaced it, and the next unshard would undo it.
  void check_variable_holds_shard() const;

  // --- gradients ----------------------------------------------------------------
  // Whether the variable holds the unsharded parameter.
  bool unsharded() const { return status_->unsharded; }
  // Moves the unsharded gradient produced by backward out of the variable, adding any
  // gradient kept from earlier backwards with gradient sync off. Undefined if none, or
  // when the parameter is sharded (then the variable's gradient is the sharded one).
  at::Tensor take_unsharded_grad();
  // Keeps an unsharded gradient for a later synchronising backward.
  void keep_unsharded_grad(at::Tensor grad);
  // The gradient laid out for reduce-scatter: [shards x padded_numel], rank-major.
  CommBuffer reduce_scatter_input(const at::Tensor& unsharded_grad,
                                  c10::ScalarType reduce_dtype) const;
  c10::ScalarType reduce_dtype(const at::Tensor& unsharded_grad) const;
  // reduced: this rank's [padded_numel] chunk of the reduced gradient. Adds it to the
  // sharded gradient (or the fp32 main grad); when there is none yet and dtype, device and
  // layout allow, the gradient is a view of `reduced` (no copy). `partial`: not yet
  // all-reduced over the replicate dimension (set_requires_all_reduce(false)).
  void accumulate_sharded_grad(const at::Tensor& reduced, bool partial);
  // The sharded gradient when it is partial, removed from the parameter, as a
  // [padded_numel] tensor of `dtype` (zero padded); undefined otherwise. It joins the
  // next all-reduce so that every contribution is all-reduced exactly once.
  at::Tensor take_partial_grad(c10::ScalarType dtype);
  // The fp32 main grad (apply_grad_on_fp32_main_grad), undefined otherwise.
  const at::Tensor& main_grad() const { return main_grad_; }
  // The sharded gradient, wherever it is kept (undefined if none).
  at::Tensor sharded_grad_or_undefined() { return sharded_grad(); }
  void zero_grad();

  // --- error feedback (CommPolicy::error_feedback) --------------------------------
  // What this rank's quantized reduce-scatters of the gradient have not carried yet: fp32
  // [shards x padded_numel], rank-major like reduce_scatter_input(), kept from one
  // reduction to the next. Undefined before the first reduction and without error feedback.
  const at::Tensor& residual() const { return residual_; }
  std::vector<int64_t> residual_shape() const { return {layout_.shards, layout_.padded_numel}; }
  // The residual the next reduction carries, on `device`: zeros when there is none yet; one
  // loaded from a checkpoint moves there.
  const at::Tensor& residual_on(c10::Device device);
  // Replaces it (undefined: zeros at the next reduction). Throws c10::ValueError for another
  // shape or dtype.
  void set_residual(const at::Tensor& residual);

 private:
  // The padded shard, its view and the unsharded buffers, for orig_dtype_ and
  // compute_device_ (the shard zero, the unsharded storage not allocated yet).
  void make_storage();
  // The variable holds the shard's data (sharded_view_).
  void point_variable_at_shard();
  // Whether unsharding needs no buffer of its own: one shard rank that does not
  // communicate, no cast, no move.
  bool unsharded_aliases_shard() const;
  // Whether the shard and its gradient live in pinned host memory, so that copies between
  // them and the GPU need not block the host.
  bool offloads_pinned() const {
    return policy_.offload && policy_.pin_memory && compute_device_.is_cuda();
  }
  // `local` (on the compute device) as a new contiguous tensor of `dtype` where the shard
  // lives. Into pinned host memory the copy is asynchronous, on the current stream.
  at::Tensor copy_to_shard_memory(const at::Tensor& local, c10::ScalarType dtype) const;
  // A gradient reaches the parameter only while it is unsharded: between the module's
  // pre-backward and post-backward hooks. One that reaches the shard comes from a forward
  // that ran without fully_shard's hooks (the module called through its plain holder):
  // unreduced, it would let the ranks diverge silently. The hook reports it instead.
  void report_gradients_on_shard();

  std::string name_;
  at::Tensor variable_;
  ShardLayout layout_;
  c10::ScalarType orig_dtype_;
  c10::ScalarType param_dtype_;
  ParamPolicy policy_;
  c10::Device compute_device_;
  at::Tensor padded_shard_;  // [padded_numel], orig dtype; padding stays zero
  at::Tensor sharded_view_;  // local shard shape, a view of padded_shard_
  // Shared with the gradient hook, which may outlive this object (with the variable).
  struct Status {
    bool unsharded = false;
    std::string owner = "module";
  };
  std::shared_ptr<Status> status_ = std::make_shared<Status>();
  // The persistent unsharded parameter (global shape, param dtype) and its storage seen
  // flat: [shards x padded_numel] rank-major for Shard(0) (the all-gather lands in it),
  // [numel] otherwise. Undefined when unsharding aliases the shard.
  at::Tensor unsharded_param_;
  at::Tensor unsharded_flat_;
  at::Tensor accumulated_unsharded_grad_;
  at::Tensor main_grad_;
  bool grad_is_partial_ = false;
  // The sharded gradient, while the variable holds unsharded data (autograd then
  // accumulates an unsharded gradient into the variable).
  at::Tensor stashed_sharded_grad_;
  at::Tensor& sharded_grad();
  at::Tensor residual_;
};

// The whole tensor from every rank's `padded` [padded_numel] part of `p` over its shard
// group (a collective). What it allocated for the gather, and `padded` when owned, is
// freed as soon as it is done: the backend's worker thread may still hold references to
// a completed collective's tensors for a while, so a dropped reference alone would not.
at::Tensor gather_whole(const FSDPParam& p, const CommBuffer& padded, const Group& shard_group);

}  // namespace hp::detail
