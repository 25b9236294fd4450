#pragma once
// Test-only views of fully_shard's internals: not part of the public API.

#include <stdexcept>

#include "hyperparallel/fully_shard.h"
#include "src/fsdp/fsdp_state.h"
#include "src/fsdp/state_registry.h"

namespace hp::testing {

// What `module`'s gradient reductions did with their reduce-scatter inputs (seed 002).
inline detail::ReduceBufferStats reduce_buffer_stats(const FSDPModule& module) {
  for (const auto& state : detail::all_states()) {
    if (FSDPModule(state) == module) return state->param_group().reduce_buffer_stats();
  }
  throw std::logic_error("reduce_buffer_stats: the module's fully_shard state is gone");
}

}  // namespace hp::testing
