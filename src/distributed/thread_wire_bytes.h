#pragma once
// The bytes the collectives issued by this thread sent, counted as hp::wire_bytes counts
// them: what one thread issued measured while others communicate too (an asynchronous
// checkpoint's writer thread, a second loop).

#include <cstdint>

namespace hp::detail {

int64_t wire_bytes_sent_by_this_thread();

}  // namespace hp::detail
