// Which modules are fully_shard-ed (module -> state) and which parameters (variable ->
// state and FSDPParam). Forward calls reach us through Sharded<M>, which knows only the
// module, and the features built on fully_shard (materialize, checkpoints, clip_grad)
// through a parameter variable, so the links live here. The registry owns nothing: a module owns
// its state through a child module (LibTorch modules have no other slot for foreign state), so
// dropping the model frees its shards, buffers and process groups.
#include "state_registry.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

#include "fsdp_param.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"

namespace hp::detail {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<FSDPState> state;
};

// A sharded parameter: the variable is alive while its state is (FSDPParam holds it), so
// its TensorImpl address is not reused while the entry is live.
struct ParamEntry {
  std::weak_ptr<FSDPState> state;
  FSDPParam* param;
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

std::unordered_map<const c10::TensorImpl*, ParamEntry>& param_registry() {
  static std::unordered_map<const c10::TensorImpl*, ParamEntry> entries;
  return entries;
}

}  // namespace

void register_state(const std::shared_ptr<torch::nn::Module>& module,
                    std::shared_ptr<FSDPState> state) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& entries = registry();
  std::erase_if(entries, [](const auto& item) { return expired(item.second); });
  if (entries.count(module.get())) {
    C10_THROW_ERROR(ValueError, "fully_shard was already applied to this module (" +
                                    module->name() + "); apply it once per module");
  }
  entries[module.get()] = Entry{module, state};
  auto& params = param_registry();
  std::erase_if(params, [](const auto& item) { return item.second.state.expired(); });
  for (const auto& p : state->param_group().params()) {
    params[p->variable().unsafeGetTensorImpl()] = ParamEntry{state, p.get()};
  }
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

std::pair<std::shared_ptr<FSDPState>, FSDPParam*> find_fsdp_param(const at::Tensor& variable) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto found = param_registry().find(variable.unsafeGetTensorImpl());
  if (found == param_registry().end()) return {nullptr, nullptr};
  auto state = found->second.state.lock();
  if (!state) return {nullptr, nullptr};
  return {std::move(state), found->second.param};
}

}  // namespace hp::detail
