#pragma once
// Deferred initialization: construct a model without allocating its tensors; then
// materialize() (materialize.h) gives each parameter and buffer its value one tensor at
// a time.
//
//   torch::manual_seed(0);
//   auto model = hp::deferred_init([&] { return hp::Sharded<Transformer>(config); });
//   for (auto& block : model->layers) hp::fully_shard(block);  // shards allocated here,
//   hp::fully_shard(model);                                    // still without values
//   hp::materialize(*model);  // every parameter and buffer: its default init, bit for bit
//
// deferred_init records the tensor operations of the construction (every operator call
// that makes a tensor without tensor inputs, or has a deferred tensor among its inputs)
// and returns tensors on the meta device in their place. materialize() runs the record
// again on real tensors, in the recorded order, from the default generators' states at
// record time, so the values are exactly those of an eager construction after the same
// torch::manual_seed. Replay frees each tensor after its last use: a fully_shard-ed model
// never holds more than its shards and about one whole parameter.
//
// What differs from eager construction:
//  * deferred_init does not advance the default generators (nothing is drawn), and
//    materialize() leaves them as they were: code that draws after construction sees
//    other numbers than after an eager construction. Seed again if that matters.
//  * Construction code must not read tensor values (item(), equal(), nonzero(), boolean
//    masks, data_ptr()): there are none yet. The operators that need them fail with an
//    error naming them. Shapes, dtypes and devices are all there.
//  * An explicit at::Generator passed to the construction is used as it is at
//    materialize() time, not as it was during construction.
//  * Real tensors the construction reads (e.g. to copy_ from) are kept and read at
//    materialize() time.
//  * Only parameters and buffers are materialized. Other tensor members stay on the meta
//    device (and keep the record alive).
//  * Changes to a deferred tensor after deferred_init returned are not recorded; make them
//    inside the construction, or in materialize's init function, or after materialize().

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <utility>

#include "hyperparallel/detail/deferred_init_recording.h"

namespace hp {

// Runs construct() with recording on and returns its result (e.g. a module holder). No
// memory is allocated for the tensors it makes; they are deferred meta tensors.
template <typename Fn>
auto deferred_init(Fn&& construct) {
  detail::DeferredInitRecording recording;
  return std::forward<Fn>(construct)();
}

// Whether `tensor` was made by deferred_init and has not been materialized yet.
bool is_deferred(const at::Tensor& tensor);

}  // namespace hp
