#pragma once
// One sharded parameter: its padded local shard, the unsharded tensor installed for
// forward/backward, and its gradient on the way from unsharded to sharded.
//
// The registered parameter variable keeps its identity throughout (module members,
// parameters() and optimizer state all refer to it); only its data is swapped with
// set_data between the local shard and the unsharded tensor.

#include <ATen/core/Tensor.h>

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
};

// Where dim `dim` of `global_shape` is cut into `world` chunks of `chunk` entries; this
// rank holds `local` of them (the last ranks may hold fewer, or none: padding).
struct ShardLayout {
  std::vector<int64_t> global_shape;
  int64_t dim = 0;
  int64_t world = 1;
  int64_t rank = 0;
  int64_t chunk = 0;
  int64_t local = 0;
  std::vector<int64_t> padded_local_shape;  // global shape with dim -> chunk
  int64_t padded_numel = 0;

  ShardLayout(std::vector<int64_t> shape, int64_t shard_dim, int64_t world_size,
              int64_t rank_in_group);
  std::vector<int64_t> local_shape() const;
};

// A gradient laid out for reduce-scatter ([world x padded_numel], rank-major), and
// whether this library allocated it. Seed 002: when no cast, pad or reorder was needed
// it is a view of the caller's gradient and must never be freed by us.
struct ReduceScatterInput {
  at::Tensor flat;
  bool owned = false;
};

class FSDPParam {
 public:
  FSDPParam(std::string name, at::Tensor variable, int64_t shard_dim, int64_t shard_world,
            int64_t shard_rank, ParamPolicy policy);

  const std::string& name() const { return name_; }
  const at::Tensor& variable() const { return variable_; }
  const ShardLayout& layout() const { return layout_; }
  c10::ScalarType orig_dtype() const { return orig_dtype_; }
  c10::ScalarType param_dtype() const { return param_dtype_; }
  bool requires_grad() const { return variable_.requires_grad(); }

  // --- unshard / reshard -------------------------------------------------------
  // The padded shard in param dtype: the shard itself when no cast is needed.
  at::Tensor all_gather_input() const;
  // gathered: [world x padded_numel], rank-major. The whole parameter: a view of
  // `gathered` for Shard(0), a reordered copy otherwise.
  at::Tensor assemble_full(const at::Tensor& gathered) const;
  // Installs assemble_full(gathered) (gathered in param dtype) as the variable's data.
  void install_unsharded(const at::Tensor& gathered);
  // Part `index` of `parts` equal parts of the gathered buffer (a copy): what this rank
  // keeps after forward when resharding to a group of `parts` ranks.
  at::Tensor post_forward_shard(int64_t index, int64_t parts) const;
  // The padded shard in the parameter's own dtype, on the compute device.
  at::Tensor padded_shard() const { return padded_shard_.to(compute_device_); }
  // A local-shard-shaped tensor laid out as a [padded_numel] shard of `dtype`.
  at::Tensor pad_local(const at::Tensor& local, c10::ScalarType dtype) const;
  void install_sharded();
  bool is_unsharded() const { return unsharded_; }
  // This rank's part of a tensor shaped like the whole parameter (a view; may be empty).
  at::Tensor local_part(const at::Tensor& full) const;
  // Copies this rank's part of the whole parameter into the shard (padding stays zero).
  void load_full(const at::Tensor& full);
  // The local shard in the parameter's own dtype and shape (a view of the padded shard).
  const at::Tensor& sharded_view() const { return sharded_view_; }

  // --- gradients ----------------------------------------------------------------
  // Moves the unsharded gradient produced by backward out of the variable, adding any
  // gradient kept from earlier backwards with gradient sync off. Undefined if none, or
  // when the parameter is sharded (then the variable's gradient is the sharded one).
  at::Tensor take_unsharded_grad();
  // Keeps an unsharded gradient for a later synchronising backward.
  void keep_unsharded_grad(at::Tensor grad);
  ReduceScatterInput reduce_scatter_input(const at::Tensor& unsharded_grad,
                                          c10::ScalarType reduce_dtype) const;
  c10::ScalarType reduce_dtype(const at::Tensor& unsharded_grad) const;
  // reduced: this rank's [padded_numel] chunk of the reduced gradient. Adds it to the
  // sharded gradient (or the fp32 main grad). `partial`: not yet all-reduced over the
  // replicate dimension (set_requires_all_reduce(false)).
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

 private:
  std::string name_;
  at::Tensor variable_;
  ShardLayout layout_;
  c10::ScalarType orig_dtype_;
  c10::ScalarType param_dtype_;
  ParamPolicy policy_;
  c10::Device compute_device_;
  at::Tensor padded_shard_;  // [padded_numel], orig dtype; padding stays zero
  at::Tensor sharded_view_;  // local shard shape, a view of padded_shard_
  bool unsharded_ = false;
  at::Tensor gathered_;  // while unsharded: the [world x padded_numel] all-gather output
  at::Tensor accumulated_unsharded_grad_;
  at::Tensor main_grad_;
  bool grad_is_partial_ = false;
  // The sharded gradient, while the variable holds unsharded data (autograd then
  // accumulates an unsharded gradient into the variable).
  at::Tensor stashed_sharded_grad_;
  at::Tensor& sharded_grad();
};

// The whole tensor from every rank's `padded` [padded_numel] part of `p` over its shard
// group (a collective).
at::Tensor gather_whole(const FSDPParam& p, const at::Tensor& padded, const Group& shard_group);

}  // namespace hp::detail
