#pragma once
// Internals of hp::deferred_init (deferred_init.h) that must be in a header because
// deferred_init is a template: the scope that records while construction runs. Not part of
// the API.

#include <memory>

namespace hp::detail {

// Records this thread's tensor operations while alive; nests (an inner one adds to the
// outer record). Use deferred_init rather than this.
class DeferredInitRecording {
 public:
  DeferredInitRecording();
  ~DeferredInitRecording();
  DeferredInitRecording(const DeferredInitRecording&) = delete;
  DeferredInitRecording& operator=(const DeferredInitRecording&) = delete;

 private:
  struct State;
  std::unique_ptr<State> state_;  // null when nested in another recording
};

}  // namespace hp::detail
