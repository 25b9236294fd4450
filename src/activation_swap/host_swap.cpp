// Activation swap of GPU storages: out to pinned host memory and back, both copies on a
// side stream so that compute goes on meanwhile, ordered against compute by events. No
// host thread ever waits. Written with the device-generic c10 stream and event API, so it
// builds without CUDA; it runs only for storages on a GPU.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

#include "swapped_storage.h"

namespace hp::detail {
namespace {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// `side` starts its next work after what the current stream has queued so far.
void after_current_stream(c10::Stream side) {
  c10::Event point(side.device_type());
  point.record(current_stream(side.device()));
  point.block(side);
}

at::Tensor bytes_of(const c10::Storage& storage, c10::Device device) {
  const auto bytes = static_cast<int64_t>(storage.nbytes());
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device))
      .set_(storage, 0, {bytes}, {1});
}

class HostSwappedStorage final : public SwappedStorage {
 public:
  HostSwappedStorage(const c10::Storage& storage, c10::Stream side)
      : side_(side), bytes_(static_cast<int64_t>(storage.nbytes())) {
    const at::Tensor on_device = bytes_of(storage, side_.device());
    host_ = at::empty({bytes_}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    after_current_stream(side_);  // compute has written the storage
    {
      const c10::StreamGuard on_side(side_);
      host_.copy_(on_device, /*non_blocking=*/true);
    }
    // Freed when the saved tensor is dropped, the device memory is handed out again only
    // after the side stream has read it.
    on_device.record_stream(side_);
  }

  bool load() override {
    if (back_.defined()) return false;
    // Allocated for the current (compute) stream, which may still use that memory's
    // previous tensor: the copy waits for it.
    back_ = at::empty({bytes_}, at::TensorOptions().dtype(at::kByte).device(side_.device()));
    after_current_stream(side_);
    {
      const c10::StreamGuard on_side(side_);
      back_.copy_(host_, /*non_blocking=*/true);
    }
    back_.record_stream(side_);
    copied_.emplace(side_.device_type());
    copied_->record(side_);
    return true;
  }

  bool loaded() override { return back_.defined() && copied_->query(); }

  c10::Storage wait() override {
    load();
    const c10::Stream current = current_stream(side_.device());
    copied_->block(current);
    back_.record_stream(current);  // used there, whichever stream it was allocated for
    return back_.storage();
  }

  void drop() override {
    back_ = at::Tensor();
    copied_.reset();
  }

 private:
  c10::Stream side_;
  int64_t bytes_;
  // Written only by the side stream and read only by it (the copy back), in its order; the
  // host allocator keeps the pinned block until the copies that use it are done.
  at::Tensor host_;
  at::Tensor back_;
  std::optional<c10::Event> copied_;
};

}  // namespace

std::unique_ptr<SwappedStorage> swap_to_host(const c10::Storage& storage, c10::Stream side) {
  return std::make_unique<HostSwappedStorage>(storage, side);
}

}  // namespace hp::detail
