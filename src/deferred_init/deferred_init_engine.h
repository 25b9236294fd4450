#pragma once
// The record/replay engine behind hp::deferred_init, for the layers above the runtime
// (fully_shard, materialize). It knows tensors, not modules or FSDP.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <vector>

namespace hp::detail {

// For a tensor hp::deferred_init made that still waits for its value: the device the
// recorded construction asked for (CPU unless it named one). nullopt for a real tensor.
// Throws for a meta tensor that no deferred_init recorded: nothing could ever give it
// values.
std::optional<c10::Device> deferred_device(const at::Tensor& tensor);

// Called with the index (into the tensors given to replay_deferred) and the final value
// of one deferred tensor, as soon as the replay has produced it. The value is dropped
// after the call unless the callee keeps it.
using DeliverFn = std::function<void(size_t index, const at::Tensor& value)>;

// Runs the recorded constructions of the deferred ones among `tensors` again, on real
// tensors on their devices and in recorded order, from the default generators' recorded
// states (left afterwards as they were before), and delivers each requested tensor's
// final value; each then counts as materialized. Tensors that are not deferred are
// skipped. Real tensors are freed after their last use, so what lives at once is what
// deliver keeps plus normally one parameter.
void replay_deferred(const std::vector<at::Tensor>& tensors, const DeliverFn& deliver);

// Marks a deferred tensor as materialized without a replay (its value came from
// elsewhere, e.g. a user init function). No-op for other tensors.
void mark_materialized(const at::Tensor& tensor);

}  // namespace hp::detail
