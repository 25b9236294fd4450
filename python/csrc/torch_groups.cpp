#include "torch_groups.h"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "distributed/group_access.h"

namespace hp::python {
namespace {

c10::intrusive_ptr<c10d::Backend> backend_or_null(c10d::ProcessGroup& group,
                                                  c10::DeviceType device_type) {
  return group.hasBackendForDeviceType(device_type) ? group.getBackend(device_type)
                                                    : c10::intrusive_ptr<c10d::Backend>();
}

}  // namespace

GroupPtr adopt_process_group(const pybind11::object& process_group, std::vector<int64_t> ranks,
                             c10::Device device, std::chrono::milliseconds timeout) {
  auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  TORCH_CHECK_VALUE(group->getSize() == static_cast<int64_t>(ranks.size()), "process group '",
                    group->getGroupName(), "' has ", group->getSize(), " ranks, but ", ranks.size(),
                    " global ranks were given for it");
  auto cpu = backend_or_null(*group, c10::DeviceType::CPU);
  auto cuda = backend_or_null(*group, c10::DeviceType::CUDA);
  TORCH_CHECK_VALUE(cpu || cuda, "process group '", group->getGroupName(),
                    "' has no backend for CPU or CUDA tensors: initialize torch.distributed with "
                    "gloo (CPU) or nccl (CUDA)");
  return detail::GroupAccess::adopt("torch/" + group->getGroupName(), std::move(ranks),
                                    group->getRank(), device, std::move(cpu), std::move(cuda),
                                    timeout);
}

GroupPtr group_of_one(int64_t rank, c10::Device device, std::chrono::milliseconds timeout) {
  return detail::GroupAccess::adopt("self/" + std::to_string(rank), {rank}, 0, device, nullptr,
                                    nullptr, timeout);
}

}  // namespace hp::python
