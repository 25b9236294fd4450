#pragma once
// The world of ranks (one TCPStore, one collective timeout) and the process groups
// created over it. A Group of size 1 has no backend (unless
// WorldOptions::one_rank_groups_communicate): collectives on it do no communication and
// return no-op handles.

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace hp {

class DeviceMesh;
struct LaunchEnv;

namespace detail {
struct GroupAccess;
}  // namespace detail

// Made by World::new_group (and a DeviceMesh's dims).
class Group {
 public:
  ~Group();

  const std::string& name() const { return name_; }
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  int64_t rank() const { return rank_; }  // this process's rank within the group
  const std::vector<int64_t>& ranks() const { return ranks_; }  // global ranks, ascending

  // The device the group communicates on: its World's (World::device()).
  c10::Device device() const { return device_; }
  // Whether CPU tensors are communicated as they are, by Gloo: on a CPU World always; on a
  // GPU World only when asked for (WorldOptions::gloo_on_gpu). Without it, the
  // collectives of collectives.h move CPU tensors through device() and back. (A group of
  // one rank has no backend at all unless it communicates(): nothing is communicated.)
  bool has_cpu_backend() const { return cpu_backend_ != nullptr; }
  // Whether collectives on this group go through a backend: groups of two or more ranks,
  // and groups of one on a World with WorldOptions::one_rank_groups_communicate.
  bool communicates() const { return size() > 1 || cpu_backend_ || cuda_backend_; }

  // How long its collectives wait for the other members: the World's timeout.
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  friend class World;
  // The library's collectives: the backends they issue on, and how what they issue fails
  // (src/distributed/group_access.h).
  friend struct detail::GroupAccess;
  // World::shutdown: ends the backends; collectives throw from then on.
  void shut_down();
  // `store` (the world's): where members report a failed collective to one another.
  Group(std::string name, std::vector<int64_t> ranks, int64_t rank_in_group, c10::Device device,
        c10::intrusive_ptr<c10d::Backend> cpu_backend,
        c10::intrusive_ptr<c10d::Backend> cuda_backend, c10::intrusive_ptr<c10d::Store> store,
        std::chrono::milliseconds timeout);

  std::string name_;
  std::vector<int64_t> ranks_;
  int64_t rank_;
  c10::Device device_;
  c10::intrusive_ptr<c10d::Backend> cpu_backend_;
  c10::intrusive_ptr<c10d::Backend> cuda_backend_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  mutable int64_t collectives_issued_ = 0;
  // Set once a collective or transfer of any group of the World failed (World sets it):
  // the backends may still run operations that wait for a stopped peer, and destroying one
  // would wait for each to time out (Gloo joins its threads), delaying the error past the
  // timeout (a program prints it after the stack unwinds). They are left for the
  // process's exit.
  std::shared_ptr<std::atomic<bool>> failed_ = std::make_shared<std::atomic<bool>>(false);
  // Transfers so far per (source, destination, tag), in world ranks: both ends count the
  // same, as the backend matches sends to receives in order.
  mutable std::map<std::tuple<int64_t, int64_t, int>, int64_t> transfers_;
  bool shut_down_ = false;
};

using GroupPtr = std::shared_ptr<Group>;

struct WorldOptions {
  // How long start-up (reaching the store, every rank arriving, each group's creation)
  // and every collective wait for the other ranks before failing: a rank that died or
  // never started makes the others fail after this, with an error naming the ranks that
  // did not arrive, never hang. Unset: HP_TIMEOUT_S from the environment (seconds), else
  // 5 minutes.
  std::optional<std::chrono::milliseconds> timeout;
  // On a GPU World, also give every group a Gloo backend, so that CPU tensors are
  // communicated without passing through the GPU. Off by default, as in an NCCL-only
  // PyTorch job: no Gloo connections are made, and CPU tensors (flags, counts, checkpoint
  // metadata) travel through the GPU. A CPU World always has Gloo.
  bool gloo_on_gpu = false;
  // For testing the communication paths with one process (one GPU): groups of one rank
  // get a real one-rank backend (Gloo, or NCCL on a GPU World), and collectives and
  // fully_shard take the paths of groups of several ranks (the communication streams,
  // held memory, coalesced and fused collectives, the all-reduce of replicated parameters)
  // instead of skipping communication. Results are the same; it only costs time. Unset:
  // on when HP_ONE_RANK_GROUPS_COMMUNICATE=1 is in the environment.
  std::optional<bool> one_rank_groups_communicate;
  // Fail start-up with c10::ValueError, naming the rank and what it sees, unless every rank
  // computes on a GPU of its own. Without it such a job runs on the CPU with Gloo and
  // warns. Unset: on when HP_REQUIRE_GPU=1 is in the environment.
  std::optional<bool> require_gpu;
};

class World {
 public:
  // Joins the ranks described by the torchrun-style environment (see LaunchEnv): rank 0
  // hosts a TCPStore on MASTER_PORT (under torchrun, its agent does), every rank
  // registers there and waits for all the others. Throws c10::DistNetworkError naming the
  // missing ranks, or c10::ValueError naming a bad variable, within the timeout.
  // Sets SIGPIPE to be ignored unless the program handles it (as Python does): a peer that
  // is gone then fails a collective with an error instead of killing this rank.
  static std::shared_ptr<World> from_env(WorldOptions options = {});
  static std::shared_ptr<World> create(const LaunchEnv& env, WorldOptions options = {});
  ~World();

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // The group of all ranks.
  const GroupPtr& world_group() const { return world_group_; }

  // Creates the group `ranks` (global ranks, which must contain this rank) under a
  // name unique among groups of this World. Every member must call it, and all members
  // must create their groups in the same order (the rendezvous blocks until all joined,
  // at most timeout(), then throws naming the members that did not come).
  // Names are never reused: a second new_group with a known name throws.
  GroupPtr new_group(const std::string& name, std::vector<int64_t> ranks);
  // The group created under `name` by this rank, or null.
  GroupPtr find_group(const std::string& name) const;

  // The device this rank computes on: a GPU of its own when every rank of the World has
  // one (cuda:0 when the process sees one device, as under a launcher that sets
  // CUDA_VISIBLE_DEVICES per process; else cuda:LOCAL_RANK), made the current device at
  // start-up, the World's NCCL backends bound to it. Else the CPU for all of them, with a
  // warning naming the rank without a GPU (or two ranks sharing one: NCCL cannot), unless
  // WorldOptions::require_gpu makes that an error.
  c10::Device device() const { return device_; }

  // Ends every process group of this World before exit (PyTorch's
  // destroy_process_group): NCCL communicators are destroyed, Gloo's connections
  // dropped. Call it on every rank after the last collective has completed; collectives
  // and new_group on this World throw afterwards. A second call does nothing.
  void shutdown();

 private:
  friend class DeviceMesh;
  // 0, 1, 2, ... per call: names meshes consistently on all ranks (who build the same
  // meshes in the same order), so their groups get distinct names.
  int64_t next_mesh_id() { return mesh_count_++; }

  World(int64_t rank, int64_t size, std::string address, c10::intrusive_ptr<c10d::Store> store,
        std::chrono::milliseconds timeout, c10::Device device, bool gloo_on_gpu,
        bool one_rank_groups_communicate);
  // After the world group's rendezvous: device_ stays a GPU only if every rank has one of
  // its own; else all compute on the CPU, with a warning, or, with `require_gpu`, throw.
  void agree_on_device(bool require_gpu);
  // Checks `ranks` (sorted here) and waits until every member arrived; returns this rank's
  // index in them.
  int join(const std::string& name, std::vector<int64_t>& ranks, const std::string& operation,
           std::chrono::steady_clock::time_point deadline);
  // The group's backends on the agreed device, after join().
  GroupPtr add_group(const std::string& name, std::vector<int64_t> ranks, int rank_in_group);

  int64_t rank_;
  int64_t size_;
  std::string local_address_;  // where this rank's Gloo transport listens
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  GroupPtr world_group_;
  std::map<std::string, GroupPtr> groups_;
  int64_t mesh_count_ = 0;
  // Shared by its groups (Group::failed_).
  std::shared_ptr<std::atomic<bool>> collective_failed_ =
      std::make_shared<std::atomic<bool>>(false);
  c10::Device device_;
  bool gloo_on_gpu_;
  bool one_rank_groups_communicate_;
  bool shut_down_ = false;
};

// The world of this process, joined from the launch environment on first use (like
// torch.distributed's default group); fully_shard uses it when given no mesh.
std::shared_ptr<World> default_world();

}  // namespace hp
