#pragma once
// What the library's collectives use of a Group beyond its public face: the c10d backend
// they issue on, and how what they issue there fails. Kept out of process_group.h: users
// communicate through collectives.h, never on a backend directly.

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hyperparallel/comm_handle.h"
#include "hyperparallel/process_group.h"

namespace c10d {
class Backend;
}  // namespace c10d

namespace hp::detail {

// Befriended by Group.
struct GroupAccess {
  // A group over backends made elsewhere (torch.distributed's, for the Python front-end): no
  // World and no store of its own, so a failure is explained without asking the other
  // members which of them reached it. Null backends: a one-rank group that does not
  // communicate.
  static GroupPtr adopt(std::string name, std::vector<int64_t> ranks, int64_t rank_in_group,
                        c10::Device device, c10::intrusive_ptr<c10d::Backend> cpu_backend,
                        c10::intrusive_ptr<c10d::Backend> cuda_backend,
                        std::chrono::milliseconds timeout);

  // The backend for tensors on `device_type`: Gloo for CPU, NCCL for CUDA (when built
  // with CUDA). Throws for groups that do not communicate(), for devices it has none for,
  // and once its World was shut down.
  static c10d::Backend& backend(const Group& group, c10::DeviceType device_type);

  // Counts a collective issued on `group` on `backend` (every member issues the same ones
  // in the same order) and returns how it fails: an error naming the operation, the group
  // and the members that did not reach it; on Gloo also past the group's timeout() from
  // now, also when it waited in the backend's queue behind another collective.
  static CommFailure on_failure(const Group& group, std::string operation,
                                const c10d::Backend& backend);

  // How a send to (or, `sending` false, a receive from) group rank `peer` with `tag` fails:
  // an error naming `what` (e.g. a pipeline's stage and microbatch; empty: the transfer
  // alone), the direction, the peer's world rank, and whether the peer saw it fail too. The
  // backend's own timeout bounds it.
  static CommFailure on_transfer_failure(const Group& group, const std::string& what, bool sending,
                                         int64_t peer, int tag);
};

}  // namespace hp::detail
