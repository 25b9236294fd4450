#pragma once
// Test-only views of fully_shard's internals: not part of the public API.

#include "hyperparallel/fully_shard.h"
#include "src/fsdp/fsdp_state.h"
#include "src/fsdp/state_registry.h"

namespace hp::testing {

// What `module`'s gradient reductions did with their reduce-scatter inputs (inputs the library
// allocated are freed; views of the caller's gradient only dropped).
inline detail::ReduceBufferStats reduce_buffer_stats(const FSDPModule& module) {
  return detail::FSDPModuleAccess::state(module)->param_group().reduce_buffer_stats();
}

// Whether two handles drive one fully_shard state (one fully_shard call over a list).
inline bool same_state(const FSDPModule& a, const FSDPModule& b) {
  return detail::FSDPModuleAccess::state(a) == detail::FSDPModuleAccess::state(b);
}

// The ranks of the group `module` keeps its parameters sharded over after forward
// (reshard_after_forward = k); empty when it reshards to the whole shard group or not at all.
inline std::vector<int64_t> post_forward_ranks(const FSDPModule& module) {
  const GroupPtr& group =
      detail::FSDPModuleAccess::state(module)->param_group().post_forward_group();
  return group ? group->ranks() : std::vector<int64_t>{};
}

}  // namespace hp::testing
