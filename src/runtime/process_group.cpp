#include "hyperparallel/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef HP_WITH_NCCL
#include <torch/cuda.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "hyperparallel/launch_env.h"

namespace hp {
namespace {

// The local address this rank uses to reach the master: the kernel's route choice for
// a UDP "connection" (no packet is sent). Gloo must listen on an address the other
// ranks can reach, and the machine's hostname may not resolve.
std::string local_address_towards(const std::string& master_addr, int master_port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(master_addr.c_str(), std::to_string(master_port).c_str(), &hints, &found) != 0 ||
      !found) {
    throw std::invalid_argument("MASTER_ADDR='" + master_addr +
                                "' does not resolve to an IPv4 address; use an address or a "
                                "resolvable host name of the rank-0 machine");
  }
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  bool ok = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (!ok) throw std::runtime_error("no network route to MASTER_ADDR='" + master_addr + "'");
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return text;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& local_address) {
  // GLOO_SOCKET_IFNAME is PyTorch's knob for the same choice; honour it.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(local_address);
}

}  // namespace

Group::Group(std::string name, std::vector<int64_t> ranks, int64_t rank_in_group,
             c10::intrusive_ptr<c10d::Backend> cpu_backend,
             c10::intrusive_ptr<c10d::Backend> cuda_backend)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      rank_(rank_in_group),
      cpu_backend_(std::move(cpu_backend)),
      cuda_backend_(std::move(cuda_backend)) {}

Group::~Group() = default;

c10d::Backend& Group::backend(c10::DeviceType device_type) const {
  if (size() == 1) {
    throw std::logic_error("group '" + name_ +
                           "' has one rank and no backend; collectives "
                           "on it must not communicate");
  }
  if (device_type == c10::DeviceType::CPU && cpu_backend_) return *cpu_backend_;
  if (device_type == c10::DeviceType::CUDA && cuda_backend_) return *cuda_backend_;
  throw std::invalid_argument("group '" + name_ + "' has no backend for " +
                              c10::DeviceTypeName(device_type) +
                              " tensors (CPU uses Gloo; CUDA needs a LibTorch built with NCCL)");
}

World::World(int64_t rank, int64_t size, std::string address, c10::intrusive_ptr<c10d::Store> store,
             WorldOptions options)
    : rank_(rank),
      size_(size),
      local_address_(std::move(address)),
      store_(std::move(store)),
      options_(options) {}

World::~World() = default;

std::shared_ptr<World> World::from_env(WorldOptions options) {
  return create(LaunchEnv::from_environment(), options);
}

std::shared_ptr<World> World::create(const LaunchEnv& env, WorldOptions options) {
  if (options.timeout.count() <= 0) {
    throw std::invalid_argument("WorldOptions::timeout must be positive");
  }
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0;
  store_options.numWorkers = static_cast<int>(env.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  store_options.useLibUV = false;  // this LibTorch is built without libuv
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  std::string address = local_address_towards(env.master_addr, env.master_port);
  std::shared_ptr<World> world(new World(env.rank, env.world_size, address, store, options));
  std::vector<int64_t> all(env.world_size);
  for (int64_t r = 0; r < env.world_size; ++r) all[r] = r;
  world->world_group_ = world->new_group("world", all);
  return world;
}

GroupPtr World::find_group(const std::string& name) const {
  auto found = groups_.find(name);
  return found == groups_.end() ? nullptr : found->second;
}

GroupPtr World::new_group(const std::string& name, std::vector<int64_t> ranks) {
  if (groups_.count(name)) {
    throw std::invalid_argument("a group named '" + name +
                                "' already exists; group names identify rendezvous and "
                                "must be unique");
  }
  std::sort(ranks.begin(), ranks.end());
  if (ranks.empty() || std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() ||
      ranks.front() < 0 || ranks.back() >= size_) {
    throw std::invalid_argument("group '" + name + "': ranks must be distinct and in [0, " +
                                std::to_string(size_) + ")");
  }
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) {
    throw std::invalid_argument("group '" + name + "' does not contain this rank (" +
                                std::to_string(rank_) + "); only members create a group");
  }
  const int rank_in_group = static_cast<int>(me - ranks.begin());
  const int group_size = static_cast<int>(ranks.size());
  c10::intrusive_ptr<c10d::Backend> cpu, cuda;
  if (group_size > 1) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("hp/" + name, store_);
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options_.timeout);
    gloo_options->devices.push_back(gloo_device(local_address_));
    cpu = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", prefixed), rank_in_group, group_size,
        gloo_options);
#ifdef HP_WITH_NCCL
    if (torch::cuda::is_available()) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options_.timeout;
      cuda = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", prefixed), rank_in_group, group_size,
          nccl_options);
    }
#endif
  }
  return groups_[name] = std::make_shared<Group>(name, std::move(ranks), rank_in_group,
                                                 std::move(cpu), std::move(cuda));
}

std::shared_ptr<World> default_world() {
  static std::shared_ptr<World> world = World::from_env();
  return world;
}

}  // namespace hp
