#include "hyperparallel/parallel_slice.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <string>

#include "hyperparallel/collectives.h"

namespace hp {
namespace {

// Slices by parameter. The weak reference tells a live parameter from a freed one
// whose address was reused.
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  ParallelSlice slice;
};

std::mutex entries_mutex;
std::map<const c10::TensorImpl*, Entry>& entries() {
  static std::map<const c10::TensorImpl*, Entry> by_param;
  return by_param;
}

}  // namespace

void declare_parallel_slice(const at::Tensor& param, ParallelSlice slice) {
  if (!param.defined()) {
    C10_THROW_ERROR(ValueError, "declare_parallel_slice: the parameter is undefined");
  }
  if (!slice.group || slice.group->size() == 1) return;
  if (slice.dim < 0 || slice.dim >= param.dim()) {
    C10_THROW_ERROR(ValueError, "declare_parallel_slice: dim " + std::to_string(slice.dim) +
                                    " is outside the parameter's " + std::to_string(param.dim()) +
                                    " dims");
  }
  std::lock_guard<std::mutex> lock(entries_mutex);
  auto& by_param = entries();
  for (auto it = by_param.begin(); it != by_param.end();) {
    it = it->second.param.expired() ? by_param.erase(it) : std::next(it);
  }
  by_param.insert_or_assign(
      param.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(slice)});
}

std::optional<ParallelSlice> parallel_slice_of(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(entries_mutex);
  auto it = entries().find(param.unsafeGetTensorImpl());
  if (it == entries().end() || it->second.param.expired()) return std::nullopt;
  return it->second.slice;
}

at::Tensor slice_of(const at::Tensor& whole, const ParallelSlice& slice) {
  const int64_t part = whole.size(slice.dim) / slice.group->size();
  return whole.narrow(slice.dim, slice.group->rank() * part, part);
}

at::Tensor join_parallel_slices(const at::Tensor& local, const ParallelSlice& slice) {
  const Group& group = *slice.group;
  at::Tensor contiguous = local.detach().contiguous();
  std::vector<int64_t> stacked_shape{group.size()};
  stacked_shape.insert(stacked_shape.end(), contiguous.sizes().begin(), contiguous.sizes().end());
  at::Tensor stacked = at::empty(stacked_shape, contiguous.options());
  all_gather(stacked, contiguous, group).wait();
  return at::cat(stacked.unbind(0), slice.dim);
}

}  // namespace hp
