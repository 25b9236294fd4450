// Replay for hp::materialize: decides which recorded ops to run for the tensors asked for,
// then runs them on real tensors in recorded order, hands each asked-for tensor's final
// value over as soon as it exists, and frees every real tensor after its last use.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "deferred_init_engine.h"
#include "deferred_log.h"

namespace hp::detail {
namespace {

enum class Mode : uint8_t {
  kSkip,
  kRun,
  // Nothing reads what it writes, but its random draws shift later ones: run it on a
  // scratch tensor that is freed at once.
  kDrawOnly,
};

struct ReplayPlan {
  std::vector<Mode> mode;                           // by op
  std::vector<std::vector<ValueId>> deliver_after;  // by op
  std::vector<std::vector<ValueId>> drop_after;     // by op
};

// Walks the record backwards, keeping the values and alias groups a later running op
// needs: an op runs when it makes a needed value or writes into a needed group. An op
// that overwrites the only tensor on a storage ends that storage's earlier life, so what
// it held before is needed no more (replay allocates the tensor anew there).
std::vector<Mode> choose_ops(const DeferredLog& log, const std::vector<ValueId>& wanted) {
  std::vector<Mode> mode(log.ops.size(), Mode::kSkip);
  std::unordered_set<ValueId> needed(wanted.begin(), wanted.end());
  std::unordered_set<GroupId> needed_groups;
  for (ValueId v : wanted) needed_groups.insert(log.group_of[v]);
  bool draws_later = false;
  for (size_t i = log.ops.size(); i-- > 0;) {
    const RecordedOp& op = log.ops[i];
    const bool writes_needed = std::any_of(op.written_groups.begin(), op.written_groups.end(),
                                           [&](GroupId g) { return needed_groups.count(g) > 0; });
    const bool makes_needed =
        std::any_of(op.outputs.begin(), op.outputs.end(), [&](const auto& made) {
          return std::any_of(made.begin(), made.end(),
                             [&](const auto& m) { return needed.count(m.second) > 0; });
        });
    if (writes_needed || makes_needed) {
      mode[i] = Mode::kRun;
    } else if (op.draws_random && draws_later) {
      mode[i] = op.overwrite && op.reads.empty() ? Mode::kDrawOnly : Mode::kRun;
    }
    if (mode[i] == Mode::kRun) {
      if (op.overwrite) {
        needed.erase(op.overwrite->value);
        needed_groups.erase(log.group_of[op.overwrite->value]);
      }
      for (ValueId v : op.reads) {
        needed.insert(v);
        needed_groups.insert(log.group_of[v]);
      }
    }
    if (mode[i] != Mode::kSkip && op.draws_random) draws_later = true;
  }
  return mode;
}

ReplayPlan plan_replay(const DeferredLog& log, const std::vector<ValueId>& wanted) {
  ReplayPlan plan;
  plan.mode = choose_ops(log, wanted);
  const size_t n = log.ops.size();
  plan.deliver_after.resize(n);
  plan.drop_after.resize(n);

  // A value is final after the last running op that makes it or writes into its group.
  std::unordered_map<ValueId, size_t> made_at;
  std::unordered_map<GroupId, size_t> last_write;
  for (size_t i = 0; i < n; ++i) {
    if (plan.mode[i] != Mode::kRun) continue;
    for (const auto& made : log.ops[i].outputs) {
      for (const auto& [position, value] : made) made_at[value] = i;
    }
    for (GroupId g : log.ops[i].written_groups) last_write[g] = i;
  }
  for (ValueId v : wanted) {
    auto made = made_at.find(v);
    auto written = last_write.find(log.group_of[v]);
    if (made == made_at.end() && written == last_write.end()) {
      C10_THROW_ERROR(Error, "hp::materialize: internal error: the replay never produces value " +
                                 std::to_string(v));
    }
    const size_t final_at = std::max(made == made_at.end() ? 0 : made->second,
                                     written == last_write.end() ? 0 : written->second);
    plan.deliver_after[final_at].push_back(v);
  }

  // Backwards again: a tensor is freed after its last use; a whole overwrite starts a new
  // life of the value, so the old one is freed after its own last use before it.
  std::unordered_set<ValueId> used_later;
  for (size_t i = n; i-- > 0;) {
    if (plan.mode[i] != Mode::kRun) continue;
    const RecordedOp& op = log.ops[i];
    auto touch = [&](ValueId v) {
      if (used_later.insert(v).second) plan.drop_after[i].push_back(v);
    };
    for (ValueId v : op.reads) touch(v);
    for (const auto& made : op.outputs) {
      for (const auto& [position, value] : made) touch(value);
    }
    for (ValueId v : plan.deliver_after[i]) touch(v);
    if (op.overwrite) {
      touch(op.overwrite->value);
      used_later.erase(op.overwrite->value);
    }
  }
  return plan;
}

std::string name_of(const RecordedOp& op) { return c10::toString(op.op.operator_name()); }

// The tensor at `position` (-1: the value itself) of an argument or return.
at::Tensor tensor_at(const c10::IValue& value, int64_t position) {
  if (position < 0) return value.toTensor();
  if (value.isTensorList()) return value.toTensorList().get(position);
  return value.toOptionalTensorList().get(position).value();
}

// An argument with the real tensors `lookup` gives in place of its deferred ones.
template <typename Lookup>
c10::IValue real_argument(const RecordedArg& arg, const Lookup& lookup) {
  if (arg.deferred.empty()) return arg.value;
  if (arg.deferred.size() == 1 && arg.deferred.front().first < 0) {
    return lookup(arg.deferred.front().second);
  }
  if (arg.value.isTensorList()) {
    auto list = arg.value.toTensorList().copy();
    for (const auto& [position, value] : arg.deferred) list.set(position, lookup(value));
    return list;
  }
  auto list = arg.value.toOptionalTensorList().copy();
  for (const auto& [position, value] : arg.deferred) list.set(position, lookup(value));
  return list;
}

// Runs one recorded op on real tensors; new values go into `live`. `scratch`, when
// defined, stands in for the op's overwritten tensor.
void run_op(const RecordedOp& op, std::unordered_map<ValueId, at::Tensor>& live,
            const at::Tensor& scratch) {
  auto lookup = [&](ValueId v) -> at::Tensor {
    if (scratch.defined() && v == op.overwrite->value) return scratch;
    auto found = live.find(v);
    if (found == live.end()) {
      C10_THROW_ERROR(Error, "hp::materialize: internal error: replaying " + name_of(op) +
                                 " needs value " + std::to_string(v) + ", which is not there");
    }
    return found->second;
  };
  torch::jit::Stack stack;
  for (const RecordedArg& arg : op.args) stack.push_back(real_argument(arg, lookup));
  try {
    op.op.callBoxed(stack);
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(
        Error, "hp::materialize: replaying " + name_of(op) +
                   " (recorded by hp::deferred_init) failed: " + error.what_without_backtrace());
  }
  for (size_t r = 0; r < op.outputs.size(); ++r) {
    for (const auto& [position, value] : op.outputs[r]) live[value] = tensor_at(stack[r], position);
  }
}

at::Tensor allocate(const Overwrite& overwrite) {
  return at::empty_strided(overwrite.sizes, overwrite.strides, overwrite.options);
}

void replay(const DeferredLog& log, const std::map<ValueId, std::vector<size_t>>& requests,
            const std::vector<at::Tensor>& tensors, const DeliverFn& deliver) {
  std::vector<ValueId> wanted;
  for (const auto& [value, indices] : requests) wanted.push_back(value);
  const ReplayPlan plan = plan_replay(log, wanted);

  c10::impl::ExcludeDispatchKeyGuard not_recorded(c10::DispatchKey::DeferredInit);
  c10::NoGradGuard no_grad;
  RngReplayScope generators(log.generators);
  std::unordered_map<ValueId, at::Tensor> live;
  for (size_t i = 0; i < log.ops.size(); ++i) {
    const RecordedOp& op = log.ops[i];
    if (plan.mode[i] == Mode::kSkip) continue;
    if (plan.mode[i] == Mode::kDrawOnly) {
      run_op(op, live, allocate(*op.overwrite));
      continue;
    }
    if (op.overwrite && !live.count(op.overwrite->value)) {
      live[op.overwrite->value] = allocate(*op.overwrite);
    }
    run_op(op, live, at::Tensor());
    for (ValueId v : plan.deliver_after[i]) {
      for (size_t index : requests.at(v)) {
        deliver(index, live.at(v));
        mark_materialized(tensors[index]);
      }
    }
    for (ValueId v : plan.drop_after[i]) live.erase(v);
  }
}

}  // namespace

void replay_deferred(const std::vector<at::Tensor>& tensors, const DeliverFn& deliver) {
  // One replay per record, each asked for the values its tensors stand for. The records
  // are held here: delivering the last tensor of one releases the tensor's hold on it.
  std::vector<std::pair<std::shared_ptr<DeferredLog>, std::map<ValueId, std::vector<size_t>>>>
      records;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DeferredTensorImpl* impl = pending_deferred(tensors[i]);
    if (!impl) continue;
    const DeferredValue& value = *impl->pending();
    auto same = [&](const auto& record) { return record.first == value.log; };
    auto record = std::find_if(records.begin(), records.end(), same);
    if (record == records.end()) record = records.insert(records.end(), {value.log, {}});
    record->second[value.value].push_back(i);
  }
  for (const auto& [log, requests] : records) replay(*log, requests, tensors, deliver);
}

}  // namespace hp::detail
