#pragma once
// Setting a parameter or buffer from its whole value, wherever its data lives: the shard
// of a fully_shard-ed parameter, a tensor still waiting for deferred initialization, or
// an ordinary tensor. Shared by materialize() and the full state dict / checkpoint loads.

#include <ATen/core/Tensor.h>

#include "hyperparallel/sharded_parameter.h"

namespace hp::detail {

// `shard`: the fully_shard view of `tensor`, or null when it is not sharded. A
// sharded parameter receives this rank's part of `whole` in its shard (no
// communication); a deferred tensor takes a copy of `whole` in place (same variable);
// any other tensor is copied into. A deferred tensor counts as materialized afterwards.
void set_whole_value(const at::Tensor& tensor, const at::Tensor& whole,
                     const ShardedParameter* shard);

// The sharded parameter `variable` (`shard` its view) receives `local`, this rank's part
// of its whole value (shaped like its local shard), in its shard; it counts as
// materialized afterwards.
void set_local_value(const at::Tensor& variable, const ShardedParameter& shard,
                     const at::Tensor& local);

}  // namespace hp::detail
