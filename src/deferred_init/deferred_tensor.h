#pragma once
// The tensors hp::deferred_init hands out: meta tensors (no memory) that know which value
// of which recorded construction they stand for, until materialize() delivers it.
//
// A TensorImpl subclass rather than a tag on a plain meta tensor because the tie must
// survive shallow_copy_from / set_data: fully_shard swaps a deferred parameter onto its
// real (still empty) shard before materialize(), and that swap replaces every field of
// TensorImpl but not those of a subclass.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <memory>

namespace hp::detail {

struct DeferredLog;
using ValueId = int64_t;

// What a deferred tensor stands for: value `value` of `log`, made on `device`.
struct DeferredValue {
  std::shared_ptr<DeferredLog> log;  // keeps the recording alive while the tensor waits
  ValueId value = -1;
  c10::Device device{c10::kCPU};
};

class DeferredTensorImpl final : public c10::TensorImpl {
 public:
  // A deferred tensor with the sizes, strides and (meta) storage of `like`.
  DeferredTensorImpl(const c10::TensorImpl& like, DeferredValue value);

  // What this tensor waits for; null once materialized.
  const DeferredValue* pending() const { return value_.log ? &value_ : nullptr; }
  void mark_materialized() { value_ = DeferredValue{}; }

  // Takes over what a deferred source stands for (Module::to or set_data during the
  // construction); a real source is only storage to be filled later (fully_shard's
  // shard): this tensor keeps waiting for its own value.
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;
  // Detached copies (detach(), make_variable) stand for the same value.
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;

 private:
  const char* tensorimpl_type_name() const override { return "DeferredTensorImpl"; }
  template <typename Version>
  c10::intrusive_ptr<c10::TensorImpl> detached_copy(Version&& version_counter,
                                                    bool allow_tensor_metadata_change) const;

  DeferredValue value_;
};

// The deferred tensor behind `tensor` while it still waits for its value, else null.
DeferredTensorImpl* pending_deferred(const at::TensorBase& tensor);

// A new deferred tensor standing for `value`, shaped like the meta tensor `meta`.
at::Tensor make_deferred(const at::Tensor& meta, DeferredValue value);

}  // namespace hp::detail
