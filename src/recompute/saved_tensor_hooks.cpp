#include "saved_tensor_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <vector>

namespace hp::detail {
namespace {

thread_local std::vector<SavedTensorHooksFactory> active_factories;

// The base engine, except that it hands out this thread's innermost hooks.
class SavedTensorHooksEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (active_factories.empty()) return nullptr;
    return active_factories.back()();
  }
};

torch::autograd::Engine& hooks_engine() {
  // Never destroyed: backward may still run while static objects are torn down.
  static auto* engine = new SavedTensorHooksEngine();
  return *engine;
}

void install_hooks_engine() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    using torch::autograd::Engine;
    if (&Engine::get_default_engine() != &Engine::get_base_engine()) {
      C10_THROW_ERROR(Error,
                      "saved-tensor hooks (non-reentrant activation recomputation, activation "
                      "swap) need LibTorch's own autograd engine, but another one is installed "
                      "(Python's, when torch is imported into this process); use "
                      "RecomputeImpl::kReentrant there, and no activation swap");
    }
    torch::autograd::set_default_engine_stub(&hooks_engine);
  });
}

}  // namespace

SavedTensorHooksScope::SavedTensorHooksScope(SavedTensorHooksFactory factory) {
  install_hooks_engine();
  active_factories.push_back(std::move(factory));
}

SavedTensorHooksScope::~SavedTensorHooksScope() { active_factories.pop_back(); }

}  // namespace hp::detail
