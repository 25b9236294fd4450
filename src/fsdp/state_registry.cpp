// Which modules are fully_shard-ed: module -> state. Forward calls reach us through
// Sharded<M>, which knows only the module, so the link lives here. The registry owns
// nothing: a module owns its state through a child module (LibTorch modules have no
// other slot for foreign state), so dropping the model frees its shards, buffers and
// process groups.
#include "state_registry.h"

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "fsdp_state.h"
#include "hyperparallel/fully_shard.h"

namespace hp::detail {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<FSDPState> state;
};

struct StateOwner : torch::nn::Module {
  explicit StateOwner(std::shared_ptr<FSDPState> owned) : state(std::move(owned)) {}
  std::shared_ptr<FSDPState> state;
};

// The name of the owning child in the module's children.
constexpr const char* kOwnerName = "_fsdp_state";

bool expired(const Entry& entry) { return entry.module.expired() || entry.state.expired(); }

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const torch::nn::Module*, Entry>& registry() {
  static std::unordered_map<const torch::nn::Module*, Entry> entries;
  return entries;
}

}  // namespace

void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    std::shared_ptr<FSDPState> state) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& entries = registry();
  std::erase_if(entries, [](const auto& item) { return expired(item.second); });
  if (entries.count(module.get())) {
    throw std::invalid_argument("fully_shard was already applied to this module (" +
                                module->name() + "); apply it once per module");
  }
  entries[module.get()] = Entry{module, state};
  module->register_module(kOwnerName, std::make_shared<StateOwner>(std::move(state)));
}

std::vector<std::shared_ptr<FSDPState>> all_states() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<FSDPState>> states;
  for (const auto& [module, entry] : registry()) {
    if (entry.module.expired()) continue;
    if (auto state = entry.state.lock()) states.push_back(std::move(state));
  }
  return states;
}

std::shared_ptr<FSDPState> state_of(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto found = registry().find(module);
  if (found == registry().end() || found->second.module.expired()) return nullptr;
  return found->second.state.lock();
}

void run_pre_forward(FSDPState& state, const std::vector<at::Tensor*>& inputs) {
  state.pre_forward(inputs);
}

void run_post_forward(FSDPState& state, const std::vector<at::Tensor*>& outputs) {
  state.post_forward(outputs);
}

void run_forward_failed(FSDPState& state) { state.forward_failed(); }

}  // namespace hp::detail
