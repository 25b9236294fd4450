#pragma once

#include <cstdint>

namespace hp {

// What gradient reduction did with reduce-scatter inputs (seed 002: the library frees
// only buffers it allocated).
struct ReduceBufferStats {
  int64_t freed_owned = 0;   // buffers this library allocated, freed after use
  int64_t kept_aliased = 0;  // views of the caller's gradient, left alone
};

}  // namespace hp
