#include "hyperparallel/comm_handle.h"

#include <exception>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace hp {

struct CommHandle::State {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<CommHandle> parts;
  std::function<void()> on_complete;
  std::function<std::string(const std::string&)> on_failure;
  bool done = false;
};

CommHandle CommHandle::from_work(c10::intrusive_ptr<c10d::Work> work,
                                 std::function<void()> on_complete,
                                 std::function<std::string(const std::string&)> on_failure) {
  CommHandle handle;
  handle.state_ = std::make_shared<State>();
  handle.state_->work = std::move(work);
  handle.state_->on_complete = std::move(on_complete);
  handle.state_->on_failure = std::move(on_failure);
  return handle;
}

CommHandle CommHandle::deferred(std::function<void()> on_complete) {
  return from_work({}, std::move(on_complete));
}

CommHandle CommHandle::after(std::vector<CommHandle> parts, std::function<void()> on_complete) {
  CommHandle handle = deferred(std::move(on_complete));
  handle.state_->parts = std::move(parts);
  return handle;
}

void CommHandle::wait() {
  if (!state_ || state_->done) return;
  // Every part is waited even when one fails (their buffers stay in use until then), and
  // the handle is done either way: a failed collective or callback surfaces once, here,
  // and never leaves the handle pending.
  std::exception_ptr error;
  try {
    if (state_->work) state_->work->wait();
  } catch (const std::exception& failure) {
    if (state_->on_failure) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&failure);
      error = std::make_exception_ptr(std::runtime_error(
          state_->on_failure(c10_error ? c10_error->what_without_backtrace() : failure.what())));
    } else {
      error = std::current_exception();
    }
  }
  for (auto& part : state_->parts) {
    try {
      part.wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  // Mark done before running the callback so a re-entrant wait() cannot run it twice,
  // and drop what the callback captured as soon as it ran.
  state_->done = true;
  state_->work.reset();
  state_->parts.clear();
  state_->on_failure = nullptr;
  auto callback = std::move(state_->on_complete);
  state_->on_complete = nullptr;
  if (error) std::rethrow_exception(error);  // what the callback would consume is not there
  if (callback) callback();
}

bool CommHandle::pending() const { return state_ && !state_->done; }

bool CommHandle::has_work() const {
  if (!state_ || state_->done) return false;
  if (state_->work) return true;
  for (const auto& part : state_->parts) {
    if (part.has_work()) return true;
  }
  return false;
}

}  // namespace hp
