#pragma once
// What hp::deferred_init records: the operators a construction ran, in order, with their
// arguments as given, so that materialize() can run them again on real tensors.
//
// Deferred (fake) tensors are never held here, only named by value id: they own the log
// (DeferredValue::log), and a tensor -> log -> tensor cycle would keep both alive forever.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "deferred_tensor.h"
#include "rng_snapshot.h"

namespace hp::detail {

// Tensors that share storage form one alias group: a write through one of them changes
// the others.
using GroupId = int64_t;

// Deferred tensors inside one argument or return: (position in a list, or -1 for the
// argument itself, the value the tensor stands for).
using DeferredSlots = std::vector<std::pair<int64_t, ValueId>>;

// One argument as the construction passed it. Deferred tensors are left out of `value`
// (an undefined tensor in their place) and listed in `deferred`.
struct RecordedArg {
  c10::IValue value;
  DeferredSlots deferred;
};

// An op that replaces every element of a value, without reading them, while no other
// tensor shares its storage (e.g. init::normal_ on a fresh parameter): whatever the value
// held before is dead, so replay may free it earlier and allocate it anew here.
struct Overwrite {
  ValueId value;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::TensorOptions options;  // dtype and the device the construction asked for
};

struct RecordedOp {
  explicit RecordedOp(c10::OperatorHandle handle) : op(std::move(handle)) {}

  c10::OperatorHandle op;
  std::vector<RecordedArg> args;
  // Per return: the new values among its tensors (an input returned as it was, e.g. by
  // an in-place op, is none).
  std::vector<DeferredSlots> outputs;
  std::vector<ValueId> reads;           // deferred inputs whose contents it depends on
  std::vector<GroupId> written_groups;  // alias groups it changes in place
  std::optional<Overwrite> overwrite;
  bool draws_random = false;
};

struct DeferredLog {
  std::vector<RecordedOp> ops;
  std::vector<GroupId> group_of;  // by ValueId
  GroupId groups = 0;
  // Each device's default generator as it was when the construction first drew from it.
  RngSnapshot generators;

  ValueId new_value(GroupId group) {
    group_of.push_back(group);
    return static_cast<ValueId>(group_of.size()) - 1;
  }
  GroupId new_group() { return groups++; }
};

}  // namespace hp::detail
