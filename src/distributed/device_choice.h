#pragma once
// Which device each rank computes on: a GPU of its own when every rank of the job has one,
// else the CPU for all of them (NCCL cannot put two ranks on one GPU, and a group cannot
// mix Gloo and NCCL). Each rank describes what it sees; the rule is a function of all the
// descriptions, so it is tested without GPUs.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hp::detail {

// What one rank sees, as it tells the other ranks.
struct SeenDevice {
  int64_t rank = 0;
  std::optional<int64_t> cuda_index;  // the GPU it would use; none without one
  std::string gpu;                    // host and GPU UUID: equal for two ranks on one GPU
  std::string context;                // LOCAL_RANK, visible devices, CUDA_VISIBLE_DEVICES
};

// The GPU a rank with `local_rank` uses among `device_count` visible ones: the only one
// when one is visible (a launcher gave each process its own, through CUDA_VISIBLE_DEVICES
// as SLURM and Kubernetes do), else the one of its LOCAL_RANK; none when there is none.
std::optional<int64_t> own_cuda_index(int64_t local_rank, int64_t device_count);

// Why the ranks cannot all compute on a GPU of their own (a rank sees none, two ranks
// would share one), or nullopt when they can.
std::optional<std::string> why_not_all_on_gpus(const std::vector<SeenDevice>& ranks);

// What this process sees (LOCAL_RANK `local_rank`, rank `rank`).
SeenDevice see_device(int64_t rank, int64_t local_rank);

std::string encode(const SeenDevice& seen);
SeenDevice decode(const std::string& text);

}  // namespace hp::detail
