#pragma once
// The fully_shard view of one parameter, for code built on fully_shard that takes a plain
// model (clipping, state dicts, checkpoints). Like a DTensor it tells which part of the
// whole tensor this rank holds and which process groups hold the rest. Between steps the
// parameter variable itself holds the local shard.
//
//   for (auto& param : model->parameters())
//     if (auto sharded = hp::sharded_parameter_of(param)) whole = sharded->full();

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace hp {

class Group;
class World;

namespace detail {
class FSDPParam;
class FSDPState;
}  // namespace detail

// Cheap to copy; keeps the fully_shard state of its module alive.
class ShardedParameter {
 public:
  // This rank's part of the whole tensor, in the parameter's dtype: a view of the shard
  // (empty on ranks past the end of the shard dimension).
  const at::Tensor& local() const;
  // The gradient of local(), wherever fully_shard keeps it (also while the module is
  // unsharded); undefined when there is none.
  at::Tensor local_grad() const;
  const std::vector<int64_t>& global_shape() const;
  // local() is global_shape() narrowed to [shard_offset(), + local().size(shard_dim()))
  // along shard_dim().
  int64_t shard_dim() const;
  int64_t shard_offset() const;
  // The ranks holding the other shards, the replicas of this shard (HSDP; one rank for
  // FSDP), and both together.
  const Group& shard_group() const;
  const Group& replicate_group() const;
  const Group& data_parallel_group() const;
  // The World of its fully_shard call (whose ranks all hold a part or a replica of it,
  // across every parallel dimension of the mesh's World).
  const std::shared_ptr<World>& world() const;
  // Whether the variable holds the whole tensor now (between a forward and its backward,
  // or after unshard()): then the shard must not be read or written through this view.
  bool is_unsharded() const;

  // The whole tensor: every shard rank sends its shard as it is (no copy on the CPU); a
  // collective over shard_group().
  at::Tensor full() const;
  // The whole tensor assembled from every shard rank's `local_like`, a tensor laid out as
  // local() (the shard itself, or per-parameter optimizer state): a collective over
  // shard_group().
  at::Tensor full(const at::Tensor& local_like) const;
  // Copies this rank's part of `whole` (global_shape()) into the shard; no communication.
  void set_full(const at::Tensor& whole) const;
  // Copies `local` (shaped as local()) into the shard.
  void set_local(const at::Tensor& local) const;

  // With CommPolicy::error_feedback, what this rank's quantized reduce-scatters of the
  // gradient have not carried yet (checkpoints keep it): fp32, shaped
  // error_feedback_residual_shape(), [shard ranks x padded shard size] laid out like the
  // reduce-scatter input. Undefined before the first reduction (zeros) and without error
  // feedback, when the shape is empty.
  at::Tensor error_feedback_residual() const;
  std::vector<int64_t> error_feedback_residual_shape() const;
  // Replaces it; undefined resets it to zeros. c10::ValueError for another shape, or
  // without error feedback.
  void set_error_feedback_residual(const at::Tensor& residual) const;

 private:
  // Made only by sharded_parameter_of, from the registry of live fully_shard states.
  friend std::optional<ShardedParameter> sharded_parameter_of(const at::Tensor& variable);
  ShardedParameter(std::shared_ptr<detail::FSDPState> state, detail::FSDPParam* param);

  std::shared_ptr<detail::FSDPState> state_;
  detail::FSDPParam* param_;
};

// The view of `variable` (a parameter as in module.parameters()), or nullopt when no live
// fully_shard call shards it (replicated, ignored, or never fully_shard-ed).
std::optional<ShardedParameter> sharded_parameter_of(const at::Tensor& variable);

}  // namespace hp
