#pragma once
// Freeing and re-allocating a tensor's storage in place. Every tensor and view that shares
// the storage sees the change: after free_storage they have no data (reading them fails
// with "data is not allocated"), after allocate_storage they read the new memory.

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

namespace hp::detail {

// Releases the memory, even if views of the storage are still referenced somewhere.
void free_storage(const at::Tensor& tensor);

// Like free_storage, but hands the memory to the caller instead of freeing it: it is freed
// when the returned pointer is dropped (later, when another stream may still read it).
at::DataPtr take_storage(const at::Tensor& tensor);

// Gives the storage `nbytes` of new (uninitialized) memory from its own allocator, if it
// has none now.
void allocate_storage(const at::Tensor& tensor, int64_t nbytes);

bool storage_is_allocated(const at::Tensor& tensor);

}  // namespace hp::detail
