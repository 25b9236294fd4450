#include "hyperparallel/tensor_parallel_placement.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "hyperparallel/collectives.h"

namespace hp {
namespace {

// Placements by parameter. The weak reference tells a live parameter from a freed one
// whose address was reused.
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  TensorParallelPlacement placement;
};

std::mutex entries_mutex;
std::map<const c10::TensorImpl*, Entry>& entries() {
  static std::map<const c10::TensorImpl*, Entry> by_param;
  return by_param;
}

}  // namespace

void set_tensor_parallel_placement(const at::Tensor& param, TensorParallelPlacement placement) {
  if (!param.defined()) {
    throw std::invalid_argument("set_tensor_parallel_placement: the parameter is undefined");
  }
  if (!placement.group || placement.group->size() == 1) return;
  if (placement.dim < 0 || placement.dim >= param.dim()) {
    throw std::invalid_argument("set_tensor_parallel_placement: dim " +
                                std::to_string(placement.dim) + " is outside the parameter's " +
                                std::to_string(param.dim()) + " dims");
  }
  std::lock_guard<std::mutex> lock(entries_mutex);
  auto& by_param = entries();
  for (auto it = by_param.begin(); it != by_param.end();) {
    it = it->second.param.expired() ? by_param.erase(it) : std::next(it);
  }
  by_param.insert_or_assign(
      param.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
            std::move(placement)});
}

std::optional<TensorParallelPlacement> tensor_parallel_placement(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(entries_mutex);
  auto it = entries().find(param.unsafeGetTensorImpl());
  if (it == entries().end() || it->second.param.expired()) return std::nullopt;
  return it->second.placement;
}

at::Tensor tensor_parallel_full_tensor(const at::Tensor& local,
                                       const TensorParallelPlacement& placement) {
  const Group& group = *placement.group;
  at::Tensor contiguous = local.detach().contiguous();
  std::vector<int64_t> stacked_shape{group.size()};
  stacked_shape.insert(stacked_shape.end(), contiguous.sizes().begin(), contiguous.sizes().end());
  at::Tensor stacked = at::empty(stacked_shape, contiguous.options());
  all_gather(stacked, contiguous, group).wait();
  return at::cat(stacked.unbind(0), placement.dim);
}

}  // namespace hp
