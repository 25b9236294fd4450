#include "hyperparallel/process_group.h"

#include <c10/util/Exception.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef HP_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "device_choice.h"
#include "error_message.h"
#include "group_access.h"
#include "hyperparallel/launch_env.h"
#include "rendezvous.h"

namespace hp {
namespace {

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& local_address) {
  // GLOO_SOCKET_IFNAME is PyTorch's knob for the same choice; honour it.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(local_address);
}

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value && std::string(value) == "1";
}

std::string device_key(int64_t rank) { return "hp/device/" + std::to_string(rank); }

// Gloo writes to its sockets with writev, which raises SIGPIPE once a peer is gone: its
// default action would kill this rank without a word instead of the collective failing
// with an error naming the peer. Ignored, as Python (so every PyTorch job) ignores it; a
// handler the program installed is kept.
void ignore_sigpipe_unless_handled() {
  struct sigaction current{};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) &&
      current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

Group::Group(std::string name, std::vector<int64_t> ranks, int64_t rank_in_group,
             c10::Device device, c10::intrusive_ptr<c10d::Backend> cpu_backend,
             c10::intrusive_ptr<c10d::Backend> cuda_backend, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      rank_(rank_in_group),
      device_(device),
      cpu_backend_(std::move(cpu_backend)),
      cuda_backend_(std::move(cuda_backend)),
      store_(std::move(store)),
      timeout_(timeout) {}

Group::~Group() {
  if (!failed_->load()) return;
  for (auto* backend : {&cpu_backend_, &cuda_backend_}) (void)backend->release();
}

void Group::shut_down() {
  if (shut_down_) return;
  shut_down_ = true;
  for (auto* backend : {&cpu_backend_, &cuda_backend_}) {
    if (*backend) (*backend)->shutdown();
    backend->reset();
  }
}

c10d::Backend& detail::GroupAccess::backend(const Group& group, c10::DeviceType device_type) {
  if (group.shut_down_) {
    C10_THROW_ERROR(Error, "group '" + group.name_ +
                               "' belongs to a World that was shut down (World::shutdown); "
                               "collectives need a live World");
  }
  if (!group.communicates()) {
    C10_THROW_ERROR(Error, "group '" + group.name_ +
                               "' has one rank and no backend; collectives "
                               "on it must not communicate");
  }
  if (device_type == c10::DeviceType::CPU && group.cpu_backend_) return *group.cpu_backend_;
  if (device_type == c10::DeviceType::CUDA && group.cuda_backend_) return *group.cuda_backend_;
  if (device_type == c10::DeviceType::CPU) {
    C10_THROW_ERROR(ValueError, "group '" + group.name_ +
                                    "' has no Gloo backend for CPU tensors: this GPU job was "
                                    "started without one (set WorldOptions::gloo_on_gpu), and "
                                    "collectives.h moves CPU tensors through the GPU");
  }
  C10_THROW_ERROR(ValueError, "group '" + group.name_ + "' has no backend for " +
                                  c10::DeviceTypeName(device_type) +
                                  " tensors (CPU uses Gloo; CUDA uses NCCL, which needs a LibTorch "
                                  "built with it and a CUDA device of this rank's own: "
                                  "cuda:LOCAL_RANK)");
}

GroupPtr detail::GroupAccess::adopt(std::string name, std::vector<int64_t> ranks,
                                    int64_t rank_in_group, c10::Device device,
                                    c10::intrusive_ptr<c10d::Backend> cpu_backend,
                                    c10::intrusive_ptr<c10d::Backend> cuda_backend,
                                    std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(rank_in_group >= 0 && rank_in_group < static_cast<int64_t>(ranks.size()),
                    "group '", name, "': rank ", rank_in_group, " is not one of its ", ranks.size(),
                    " members");
  return GroupPtr(new Group(std::move(name), std::move(ranks), rank_in_group, device,
                            std::move(cpu_backend), std::move(cuda_backend), nullptr, timeout));
}

CommFailure detail::GroupAccess::on_failure(const Group& group, std::string operation,
                                            const c10d::Backend& backend) {
  const int64_t number = ++group.collectives_issued_;
  CommFailure failure;
  failure.explain = [store = group.store_, name = group.name_, ranks = group.ranks_,
                     rank = group.ranks_[group.rank_], number, operation = std::move(operation),
                     failed = group.failed_](const std::string& error) {
    failed->store(true);
    return detail::explain_failed_collective(
        store, "hp/" + name, ranks, rank,
        operation + " #" + std::to_string(number) + " over group '" + name + "'", error);
  };
  // NCCL's wait with a timeout would block the host (and has a watchdog of its own).
  if (backend.getBackendName() == "gloo") {
    failure.deadline = std::chrono::steady_clock::now() + group.timeout_;
  }
  return failure;
}

CommFailure detail::GroupAccess::on_transfer_failure(const Group& group, const std::string& what,
                                                     bool sending, int64_t peer, int tag) {
  const int64_t me = group.ranks_[group.rank_], them = group.ranks_[peer];
  const int64_t source = sending ? me : them, destination = sending ? them : me;
  const int64_t number = ++group.transfers_[{source, destination, tag}];
  const std::string transfer = std::string(sending ? "send to" : "recv from") + " world rank " +
                               std::to_string(them) + " over group '" + group.name_ + "'";
  CommFailure failure;
  failure.explain = [store = group.store_, name = group.name_,
                     pair = std::vector<int64_t>{std::min(me, them), std::max(me, them)}, me,
                     what = what.empty() ? transfer : what + " (" + transfer + ")",
                     id = "transfer " + std::to_string(source) + "->" +
                          std::to_string(destination) + " tag " + std::to_string(tag) + " #" +
                          std::to_string(number),
                     failed = group.failed_](const std::string& error) {
    failed->store(true);
    return detail::explain_failed_collective(store, "hp/" + name, pair, me, what, error, id);
  };
  return failure;
}

World::World(int64_t rank, int64_t size, std::string address, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds timeout, c10::Device device, bool gloo_on_gpu,
             bool one_rank_groups_communicate)
    : rank_(rank),
      size_(size),
      local_address_(std::move(address)),
      store_(std::move(store)),
      timeout_(timeout),
      device_(device),
      gloo_on_gpu_(gloo_on_gpu),
      one_rank_groups_communicate_(one_rank_groups_communicate) {}

World::~World() = default;

void World::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& [name, group] : groups_) group->shut_down();
}

std::shared_ptr<World> World::from_env(WorldOptions options) {
  return create(LaunchEnv::from_environment(), options);
}

std::shared_ptr<World> World::create(const LaunchEnv& env, WorldOptions options) {
  ignore_sigpipe_unless_handled();
  const std::chrono::milliseconds timeout =
      options.timeout.value_or(env.timeout.value_or(std::chrono::minutes(5)));
  if (timeout.count() <= 0) {
    C10_THROW_ERROR(ValueError, "WorldOptions::timeout must be positive");
  }
  // One deadline for the whole start-up: reaching the store and every rank arriving.
  const auto deadline = detail::Deadline::after(timeout);
  detail::StoreConnection connection = detail::connect_store(env, deadline);
  // Each World of a process keeps its keys apart: a launcher's store outlives the Worlds
  // that use it, and every rank makes its Worlds in the same order.
  static std::atomic<int64_t> worlds_made{0};
  connection.store = c10::make_intrusive<c10d::PrefixStore>(
      "hp/world_" + std::to_string(worlds_made++), connection.store);
  const detail::SeenDevice seen = detail::see_device(env.rank, env.local_rank);
  const c10::Device own =
      seen.cuda_index
          ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(*seen.cuda_index))
          : c10::Device(c10::DeviceType::CPU);
  std::shared_ptr<World> world(new World(
      env.rank, env.world_size, connection.local_address, connection.store, timeout, own,
      options.gloo_on_gpu,
      options.one_rank_groups_communicate.value_or(env_flag("HP_ONE_RANK_GROUPS_COMMUNICATE"))));
  // Read back once every rank has arrived in the world group's rendezvous below.
  const std::string described = detail::encode(seen);
  connection.store->set(device_key(env.rank),
                        std::vector<uint8_t>(described.begin(), described.end()));
  std::vector<int64_t> all(env.world_size);
  for (int64_t r = 0; r < env.world_size; ++r) all[r] = r;
  const int me = world->join(
      "world", all, "start-up join of " + std::to_string(env.world_size) + " ranks", deadline.at);
  // The world group's backends are made for the device every rank agreed on.
  world->agree_on_device(options.require_gpu.value_or(env_flag("HP_REQUIRE_GPU")));
  world->world_group_ = world->add_group("world", all, me);
  detail::leave_after_all(connection.store, "hp/world", "start-up join", all, env.rank,
                          detail::Deadline::after(timeout));
  return world;
}

void World::agree_on_device(bool require_gpu) {
  // Every rank stored its own before the join, so these reads only wait on the store host.
  auto seen = std::make_shared<std::vector<detail::SeenDevice>>();
  detail::bounded_by_store(
      "start-up join", detail::Deadline::after(timeout_), [seen, store = store_, size = size_] {
        for (int64_t r = 0; r < size; ++r) {
          const std::vector<uint8_t> theirs = store->get(device_key(r));
          seen->push_back(detail::decode(std::string(theirs.begin(), theirs.end())));
        }
      });
  if (const auto why = detail::why_not_all_on_gpus(*seen)) {
    if (require_gpu) {
      throw detail::named_failure<c10::ValueError>(
          "a GPU was required (WorldOptions::require_gpu or "
          "HP_REQUIRE_GPU=1) but the job cannot run on GPUs: " +
          *why);
    }
    // A job meant for GPUs that quietly runs on CPUs would only look slow.
    if (device_.is_cuda()) {
      TORCH_WARN("rank ", rank_, " sees ", device_, " but the whole job computes on the CPU ",
                 "(Gloo): ", *why, ". Give each rank a GPU of its own (one visible device ",
                 "per process, or LOCAL_RANK below the device count), or set HP_REQUIRE_GPU=1 ",
                 "to make this an error.");
    }
    device_ = c10::Device(c10::DeviceType::CPU);
    return;
  }
#ifdef HP_WITH_NCCL
  c10::cuda::set_device(device_.index());
#endif
}

GroupPtr World::find_group(const std::string& name) const {
  auto found = groups_.find(name);
  return found == groups_.end() ? nullptr : found->second;
}

GroupPtr World::new_group(const std::string& name, std::vector<int64_t> ranks) {
  const int rank_in_group = join(name, ranks, "creating group '" + name + "'",
                                 std::chrono::steady_clock::now() + timeout_);
  return add_group(name, std::move(ranks), rank_in_group);
}

int World::join(const std::string& name, std::vector<int64_t>& ranks, const std::string& operation,
                std::chrono::steady_clock::time_point deadline) {
  if (shut_down_) {
    C10_THROW_ERROR(
        Error, "cannot create group '" + name + "': this World was shut down (World::shutdown)");
  }
  if (groups_.count(name)) {
    C10_THROW_ERROR(ValueError, "a group named '" + name +
                                    "' already exists; group names identify rendezvous and "
                                    "must be unique");
  }
  std::sort(ranks.begin(), ranks.end());
  if (ranks.empty() || std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() ||
      ranks.front() < 0 || ranks.back() >= size_) {
    C10_THROW_ERROR(ValueError, "group '" + name + "': ranks must be distinct and in [0, " +
                                    std::to_string(size_) + ")");
  }
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) {
    C10_THROW_ERROR(ValueError, "group '" + name + "' does not contain this rank (" +
                                    std::to_string(rank_) + "); only members create a group");
  }
  // Every member arrives first, so that one missing is named (Gloo's own connection step
  // would only time out).
  if (ranks.size() > 1) {
    detail::await_ranks(store_, "hp/" + name, operation, ranks, rank_, {deadline, timeout_});
  }
  return static_cast<int>(me - ranks.begin());
}

GroupPtr World::add_group(const std::string& name, std::vector<int64_t> ranks, int rank_in_group) {
  const int group_size = static_cast<int>(ranks.size());
  struct Backends {
    c10::intrusive_ptr<c10d::Backend> cpu, cuda;
  };
  auto made = std::make_shared<Backends>();
  if (group_size > 1 || one_rank_groups_communicate_) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("hp/" + name, store_);
    const bool with_gloo = !device_.is_cuda() || gloo_on_gpu_;
    // The backends connect through the store, with no bound of their own on a stopped host.
    detail::bounded_by_store(
        "creating group '" + name + "'", detail::Deadline::after(timeout_),
        [made, prefixed, rank_in_group, group_size, with_gloo, device = device_,
         address = local_address_, timeout = timeout_] {
          if (with_gloo) {
            auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
            gloo_options->devices.push_back(gloo_device(address));
            made->cpu = c10::make_intrusive<c10d::ProcessGroupGloo>(
                c10::make_intrusive<c10d::PrefixStore>("gloo", prefixed), rank_in_group, group_size,
                gloo_options);
          }
#ifdef HP_WITH_NCCL
          if (device.is_cuda()) {
            c10::cuda::set_device(device.index());  // this thread's own current device
            auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
            nccl_options->timeout = timeout;
            made->cuda = c10::make_intrusive<c10d::ProcessGroupNCCL>(
                c10::make_intrusive<c10d::PrefixStore>("nccl", prefixed), rank_in_group, group_size,
                nccl_options);
            made->cuda->setBoundDeviceId(device);  // the communicator's device, known up front
            // The communicator now, while every member is creating the group: not in the
            // first step's backward, where its set-up would stall the first reduction.
            made->cuda->eagerConnectSingleDevice(device);
          }
#endif
        });
  }
  // Not make_shared: the constructor is World's alone.
  GroupPtr group(new Group(name, std::move(ranks), rank_in_group, device_, std::move(made->cpu),
                           std::move(made->cuda), store_, timeout_));
  group->failed_ = collective_failed_;
  return groups_[name] = group;
}

std::shared_ptr<World> default_world() {
  static std::shared_ptr<World> world = World::from_env();
  return world;
}

}  // namespace hp
