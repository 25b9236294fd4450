#pragma once
// The parameters one fully_shard call manages, and the collectives over them:
// unshard (all-gather) / reshard, and gradient reduction (reduce-scatter over the shard
// dimension, all-reduce over the replicate dimension).
//
// Unshard is a small state machine: sharded -> pending -> unsharded. "Pending" is
// always represented by a CommHandle, also when no collective is needed (shard group of
// size 1): the handle then carries the materialisation, run from the latest shard at
// the first wait(), never earlier.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm_streams.h"
#include "fsdp_collectives.h"
#include "fsdp_param.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/comm_handle.h"
#include "hyperparallel/process_group.h"

namespace hp::detail {

// Process groups of one fully_shard call. All-gather, reduce-scatter and all-reduce
// each have their own group, so that all three can be in flight at once.
struct FSDPMeshInfo {
  // Null when the groups are adopted from torch.distributed (the Python front-end).
  std::shared_ptr<World> world;
  std::vector<std::string> dims;  // the mesh's dimension names: (replicate,) shard
  GroupPtr shard;                 // the shard dimension (may have one rank): all-gathers
  GroupPtr shard_reduce;          // the same ranks: reduce-scatters
  GroupPtr replicate;             // the replicate dimension (one rank for 1-D FSDP)
  GroupPtr data_parallel;         // replicate x shard, for replicated parameters
  c10::Device device = c10::Device(c10::DeviceType::CPU);  // where the mesh computes
};

// A parameter that every rank holds in full (replicate_params, or Replicate() from
// shard_placement_fn); its gradient is all-reduced over the data-parallel ranks. The
// mixed-precision policy holds for it as for a sharded one: while the group is unsharded
// the variable holds a copy in compute_dtype, and the gradient is all-reduced in
// reduce_dtype (unset: the computed gradient's), then kept in grad_dtype().
struct ReplicatedParam {
  ReplicatedParam(std::string name, at::Tensor variable, const ParamPolicy& policy);
  // The parameter's own data, also while the variable holds the compute copy.
  const at::Tensor& data() const { return own_data.defined() ? own_data : variable; }
  // Its own dtype; fp32 with apply_grad_on_fp32_main_grad (the gradient is the main grad).
  c10::ScalarType grad_dtype() const { return fp32_main_grad ? at::kFloat : data().scalar_type(); }

  std::string name;
  at::Tensor variable;
  c10::ScalarType compute_dtype;  // param_dtype for floating-point parameters, else its own
  std::optional<c10::ScalarType> reduce_dtype;
  bool fp32_main_grad;
  at::Tensor own_data;       // set while the variable holds the compute copy
  at::Tensor reduced_grad;   // what earlier backwards already reduced
  at::Tensor unsynced_grad;  // accumulated with gradient sync off, in the reduce dtype
};

struct ReduceSettings {
  bool sync = true;            // set_requires_gradient_sync
  bool all_reduce = true;      // set_requires_all_reduce
  double divide_factor = 1.0;  // 1: sum
};

class FSDPParamGroup {
 public:
  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params,
                 std::vector<ReplicatedParam> replicated, FSDPMeshInfo mesh_info,
                 CommFusion comm_fusion, CommPolicy comm_policy);

  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  std::vector<ReplicatedParam>& replicated() { return replicated_; }
  const FSDPMeshInfo& mesh_info() const { return mesh_info_; }
  // Names trace events and error messages.
  void set_label(std::string label);
  // The streams its collectives run on: the root's, shared by the modules it drives (set
  // at the root's lazy init; until then the group's own).
  void set_streams(std::shared_ptr<CommStreams> streams) { streams_ = std::move(streams); }
  CommStreams& streams() { return *streams_; }
  // Whether some parameter keeps its shard in host memory (offload_policy).
  bool offloads() const;

  // --- unshard / reshard -------------------------------------------------------
  // A failed unshard (issuing, the collective or its completion throws) leaves the group
  // sharded and rethrows; the next unshard starts afresh.
  CommHandle unshard(bool async);
  void wait_for_unshard();
  void reshard();
  // reshard_after_forward = k: `group` holds this rank's k consecutive shard ranks.
  // Reshards keeping 1/k of each parameter; the next unshard gathers within `group`.
  void set_post_forward_group(GroupPtr group) { post_forward_group_ = std::move(group); }
  bool has_post_forward_group() const { return post_forward_group_ != nullptr; }
  const GroupPtr& post_forward_group() const { return post_forward_group_; }
  void reshard_to_post_forward_group();
  bool is_unsharded() const { return state_ == State::kUnsharded; }

  // --- gradients ----------------------------------------------------------------
  // Called before backward accumulates into replicated parameters: sets aside their
  // already reduced gradient so the new one can be told apart.
  void stash_replicated_grads();
  // Gradient reduction runs in steps so that the backward pipeline can interleave
  // them across modules (see FSDPState::post_backward):
  // 1. Takes the unsharded gradients out of the parameters. With sync off they are kept
  //    for later; with sync on the reduce-scatters are issued (asynchronously).
  void start_reduce(const ReduceSettings& settings);
  // 2. Waits for the reduce-scatters. Without a replicate all-reduce to follow (1-D FSDP
  //    or all-reduce off) the sharded gradients are installed now.
  void wait_reduce_scatter();
  // 3. Issues the fused all-reduce over the replicate dimension (asynchronously).
  void start_all_reduce();
  // 4. Waits for the all-reduces and installs the sharded gradients, running any
  //    earlier step that has not run: finishes whatever is pending.
  void finish_reduce();
  bool reduce_pending() const { return pending_.has_value(); }
  // Drops the pending reduction without installing anything (after its collectives
  // finished). Any step above that fails does this, then rethrows; a backward that
  // failed elsewhere leaves its reductions to be dropped this way.
  void discard_reduce();

  void zero_grad();
  const ReduceBufferStats& reduce_buffer_stats() const { return stats_; }

  // --- error feedback (CommPolicy::error_feedback) ------------------------------------
  // Each parameter keeps its own residual (FSDPParam::residual), so that it does not
  // depend on which parameters a reduction fuses; the group holds the policy and the
  // count of dropped blocks.
  bool error_feedback() const { return comm_policy_.error_feedback; }
  // Replaces `param`'s residual (from a checkpoint; undefined: zeros). Throws
  // c10::ValueError for another shape or dtype, or without error feedback.
  void set_residual(FSDPParam& param, const at::Tensor& residual);
  // The blocks whose residual was dropped since the last reset (a non-finite gradient
  // block cannot be carried; quantized_collectives.h). Reads the device's counter.
  int64_t dropped_residual_blocks() const;
  // Every residual back to zeros, and the count with them.
  void reset_error_feedback();

 private:
  enum class State { kSharded, kPending, kUnsharded };

  CommHandle issue_all_gather();
  void issue_reduce(const ReduceSettings& settings);
  void install_unsharded();
  // Points every parameter back at its shard; the unsharded storage goes to the
  // all-gather lane once compute is done reading it.
  void install_sharded();
  void start_replicated_reduce(const ReduceSettings& settings);
  // Throws c10::ValueError naming the module when it keeps no error-feedback residuals.
  void check_error_feedback() const;

  struct PendingReduce {
    ReduceSettings settings;
    std::vector<FSDPParam*> params;  // cleared once their sharded gradients are installed
    // The reduce-scatters; then its buffer is the fused replicate-dim all-reduce input.
    ReduceScatterResult scatter;
    std::vector<std::pair<ReplicatedParam*, at::Tensor>> replicated;  // grads being reduced
    std::vector<CommHandle> replicated_all_reduces;
    CommHandle all_reduce;  // the fused replicate-dim all-reduce of scatter.buffer
    bool partial = false;   // gradients not all-reduced over an existing replicate dim
    bool reduce_scatters_done = false;
    bool all_reduce_started = false;
  };
  void install_sharded_grads(PendingReduce& r);

  std::vector<std::unique_ptr<FSDPParam>> params_;
  std::vector<ReplicatedParam> replicated_;
  FSDPMeshInfo mesh_info_;
  CommFusion comm_fusion_;
  CommPolicy comm_policy_;
  at::Tensor dropped_residual_blocks_;  // int64 scalar on the gradients' device, when made
  std::string label_ = "module";
  State state_ = State::kSharded;
  CommHandle pending_unshard_;
  GroupPtr post_forward_group_;
  std::vector<at::Tensor> post_forward_parts_;  // set while resharded to that group
  std::optional<PendingReduce> pending_;
  ReduceBufferStats stats_;
  std::shared_ptr<CommStreams> streams_;
};

}  // namespace hp::detail
