#pragma once
// Giving the parameters and buffers of a module made by hp::deferred_init (deferred_init.h)
// their values, one tensor at a time, wherever their data lives: the shard of a
// fully_shard-ed parameter, or the tensor itself.

#include <torch/nn/module.h>

#include <functional>
#include <string>

namespace hp {

// Gives every parameter and buffer of `module` (recursively) that is still deferred its
// value, by replaying the recorded construction: the module's own default init, bit for
// bit. A parameter managed by fully_shard receives this rank's part in its shard (no
// communication); any other tensor gets the whole value in place (same variable, so
// references to it stay valid). Tensors already real are left alone.
void materialize(torch::nn::Module& module);

// The same, but each deferred parameter, in named_parameters() order, is allocated whole
// on its device, passed to `init` (under NoGradGuard) to be filled, delivered and freed
// before the next one. Buffers still come from the replay.
void materialize(torch::nn::Module& module,
                 std::function<void(const std::string& name, at::Tensor& whole)> init);

}  // namespace hp
