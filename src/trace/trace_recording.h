#pragma once
// The library's side of the timeline (trace.h): where fully_shard and the pipeline record
// their events. Users start, stop and read traces; only the library records.

#include <cstdint>
#include <string_view>

#include "hyperparallel/trace.h"

namespace hp::trace {

// Appends an event at the current time (on a GPU, a device event on the current stream);
// nothing when no trace is on.
void record(Kind kind, std::string_view op, std::string_view module);
// Sets the bytes of the latest kIssue event of `op` and `module` (recorded before its
// collectives were issued, so that on a GPU its time is where the stream starts them).
void record_bytes(std::string_view op, std::string_view module, int64_t bytes);

}  // namespace hp::trace
