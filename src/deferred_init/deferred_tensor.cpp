#include "deferred_tensor.h"

#include <utility>

namespace hp::detail {

DeferredTensorImpl::DeferredTensorImpl(const c10::TensorImpl& like, DeferredValue value)
    : c10::TensorImpl(c10::Storage(like.unsafe_storage()), like.key_set(), like.dtype()),
      value_(std::move(value)) {
  copy_tensor_metadata(&like, this, c10::VariableVersion(/*version=*/0),
                       /*allow_tensor_metadata_change=*/true);
}

void DeferredTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  c10::TensorImpl::shallow_copy_from(impl);
  const auto* source = dynamic_cast<const DeferredTensorImpl*>(impl.get());
  if (source && source->pending()) value_ = source->value_;
}

template <typename Version>
c10::intrusive_ptr<c10::TensorImpl> DeferredTensorImpl::detached_copy(
    Version&& version_counter, bool allow_tensor_metadata_change) const {
  if (!pending()) {
    return c10::TensorImpl::shallow_copy_and_detach(std::forward<Version>(version_counter),
                                                    allow_tensor_metadata_change);
  }
  auto copy = c10::make_intrusive<DeferredTensorImpl>(*this, value_);
  copy_tensor_metadata(this, copy.get(), std::forward<Version>(version_counter),
                       allow_tensor_metadata_change);
  return copy;
}

c10::intrusive_ptr<c10::TensorImpl> DeferredTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  return detached_copy(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> DeferredTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  return detached_copy(std::move(version_counter), allow_tensor_metadata_change);
}

DeferredTensorImpl* pending_deferred(const at::TensorBase& tensor) {
  if (!tensor.defined()) return nullptr;
  auto* impl = dynamic_cast<DeferredTensorImpl*>(tensor.unsafeGetTensorImpl());
  return impl && impl->pending() ? impl : nullptr;
}

at::Tensor make_deferred(const at::Tensor& meta, DeferredValue value) {
  return at::Tensor(
      c10::make_intrusive<DeferredTensorImpl>(*meta.unsafeGetTensorImpl(), std::move(value)));
}

}  // namespace hp::detail
