// Which modules are fully_shard-ed: module -> state. LibTorch modules have no slot for
// foreign state and forward calls reach us through Sharded<M>, which knows only the
// module, so the link lives here. Entries die with their module.
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
  std::shared_ptr<FSDPState> state;
};

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
  std::erase_if(entries, [](const auto& item) { return item.second.module.expired(); });
  if (entries.count(module.get())) {
    throw std::invalid_argument("fully_shard was already applied to this module (" +
                                module->name() + "); apply it once per module");
  }
  entries[module.get()] = Entry{module, std::move(state)};
}

std::vector<std::shared_ptr<FSDPState>> all_states() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<FSDPState>> states;
  for (const auto& [module, entry] : registry()) {
    if (!entry.module.expired()) states.push_back(entry.state);
  }
  return states;
}

std::shared_ptr<FSDPState> state_of(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto found = registry().find(module);
  if (found == registry().end() || found->second.module.expired()) return nullptr;
  return found->second.state;
}

void run_pre_forward(FSDPState& state, const std::vector<at::Tensor*>& inputs) {
  state.pre_forward(inputs);
}

void run_post_forward(FSDPState& state, const std::vector<at::Tensor*>& outputs) {
  state.post_forward(outputs);
}

}  // namespace hp::detail
