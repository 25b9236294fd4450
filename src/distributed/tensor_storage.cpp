#include "tensor_storage.h"

#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

namespace hp::detail {

void free_storage(const at::Tensor& tensor) { tensor.storage().unsafeGetStorageImpl()->reset(); }

at::DataPtr take_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  at::DataPtr memory = storage->set_data_ptr(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
  return memory;
}

void allocate_storage(const at::Tensor& tensor, int64_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->data() != nullptr) return;
  c10::Allocator* allocator = storage->allocator();
  if (allocator == nullptr) allocator = c10::GetAllocator(storage->device_type());
  // A device allocator allocates on the current device: make that the storage's.
  const c10::OptionalDeviceGuard on_device(storage->device_type() == c10::kCPU
                                               ? std::nullopt
                                               : std::optional<c10::Device>(storage->device()));
  at::DataPtr memory = allocator->allocate(nbytes);
  TORCH_CHECK(nbytes == 0 || memory.device() == storage->device(), "storage of ", storage->device(),
              " was allocated on ", memory.device());
  storage->set_data_ptr_noswap(std::move(memory));
  storage->set_nbytes(nbytes);
}

bool storage_is_allocated(const at::Tensor& tensor) {
  return tensor.storage().unsafeGetStorageImpl()->data() != nullptr;
}

}  // namespace hp::detail
