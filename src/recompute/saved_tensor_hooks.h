#pragma once
// Saved-tensor hooks for C++ programs. While a SavedTensorHooksScope is active on a
// thread, every tensor that autograd saves for backward on that thread goes to a hooks
// object made by the scope's factory (pack when saved, unpack when backward needs it)
// instead of being kept by the graph. The innermost scope wins.
//
// LibTorch asks its autograd engine for these hooks, and only Python's engine has any.
// The first scope therefore installs an engine that answers from this thread's scopes;
// it refuses when another engine (Python's) is installed already.

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <functional>
#include <memory>

namespace hp::detail {

using SavedTensorHooksFactory =
    std::function<std::unique_ptr<torch::autograd::SavedVariableHooks>()>;

class SavedTensorHooksScope {
 public:
  explicit SavedTensorHooksScope(SavedTensorHooksFactory factory);
  ~SavedTensorHooksScope();
  SavedTensorHooksScope(const SavedTensorHooksScope&) = delete;
  SavedTensorHooksScope& operator=(const SavedTensorHooksScope&) = delete;
};

}  // namespace hp::detail
