#include "hyperparallel/comm_handle.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <mutex>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "error_message.h"
#include "tensor_storage.h"

namespace hp {
namespace {

// A collective given up on while still in flight: the backend may still write into its
// outputs, whatever their owners do meanwhile (fully_shard frees an abandoned unshard's
// storage). Its Work and its outputs' memory are kept for the rest of the process; the
// output tensors are left without storage.
void keep_in_flight(c10::intrusive_ptr<c10d::Work> work) {
  static auto* const mutex = new std::mutex;
  static auto* const kept = new std::vector<at::DataPtr>;  // never freed, not even at exit
  // Held here, not released: LeakSanitizer then sees it kept, not lost.
  static auto* const kept_work = new std::vector<c10::intrusive_ptr<c10d::Work>>;
  std::vector<at::Tensor> outputs;
  try {
    outputs = work->result();
  } catch (const std::exception&) {  // a Work that keeps no outputs: it holds what it uses
  }
  std::lock_guard lock(*mutex);
  for (const at::Tensor& output : outputs) {
    if (output.defined() && detail::storage_is_allocated(output)) {
      kept->push_back(detail::take_storage(output));
    }
  }
  kept_work->push_back(std::move(work));
}

}  // namespace

struct CommHandle::State {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<CommHandle> parts;
  std::function<void()> on_complete;
  CommFailure failure;
  bool done = false;
};

CommHandle CommHandle::from_work(c10::intrusive_ptr<c10d::Work> work,
                                 std::function<void()> on_complete, CommFailure failure) {
  CommHandle handle;
  handle.state_ = std::make_shared<State>();
  handle.state_->work = std::move(work);
  handle.state_->on_complete = std::move(on_complete);
  handle.state_->failure = std::move(failure);
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
  std::exception_ptr error;
  try {
    if (state_->work) wait_for_work();
  } catch (const std::exception& failure) {
    if (state_->failure.explain) {
      error = std::make_exception_ptr(detail::named_failure<c10::DistBackendError>(
          state_->failure.explain(detail::message_of(failure))));
    } else {
      error = std::current_exception();
    }
  }
  // After a failure the remaining parts fail with it: waiting for each to time out and
  // report on its own would multiply the time to surface one fault (their peers are gone
  // or stuck alike). A failed collective or callback surfaces once, here, and never leaves
  // the handle pending.
  for (auto& part : state_->parts) {
    if (error) {
      part.abandon();
      continue;
    }
    try {
      part.wait();
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Mark done before running the callback so a re-entrant wait() cannot run it twice,
  // and drop what the callback captured as soon as it ran.
  auto callback = finish();
  if (error) std::rethrow_exception(error);  // what the callback would consume is not there
  if (callback) callback();
}

void CommHandle::wait_for_work() {
  c10d::Work& work = *state_->work;
  const auto& deadline = state_->failure.deadline;
  if (!deadline) {
    work.wait();
    return;
  }
  const auto left =
      std::chrono::ceil<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now());
  try {
    work.wait(std::max(left, std::chrono::milliseconds(1)));
  } catch (const std::exception&) {
    if (work.isCompleted()) throw;  // the backend's own failure
  }
  if (!work.isCompleted()) {
    keep_in_flight(std::move(state_->work));
    C10_THROW_ERROR(DistBackendError,
                    "not completed by its deadline (the timeout, counted from its issue)");
  }
}

std::function<void()> CommHandle::finish() {
  state_->done = true;
  state_->work.reset();
  state_->parts.clear();
  state_->failure = {};
  return std::exchange(state_->on_complete, nullptr);
}

void CommHandle::abandon() {
  if (!state_ || state_->done) return;
  if (state_->work && !state_->work->isCompleted()) keep_in_flight(std::move(state_->work));
  for (auto& part : state_->parts) part.abandon();
  finish();
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
