#pragma once
// The core's groups over torch.distributed's process groups: the Python front-end runs its
// collectives on the groups of the user's DeviceMesh (no second rendezvous, no second world).

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hyperparallel/process_group.h"

namespace hp::python {

// A group over the backends of `process_group` (a torch.distributed ProcessGroup) whose
// members are the global `ranks`, for tensors on `device`.
GroupPtr adopt_process_group(const pybind11::object& process_group, std::vector<int64_t> ranks,
                             c10::Device device, std::chrono::milliseconds timeout);

// A group of this rank alone, which does not communicate (the replicate dimension of 1-D FSDP).
GroupPtr group_of_one(int64_t rank, c10::Device device, std::chrono::milliseconds timeout);

}  // namespace hp::python
