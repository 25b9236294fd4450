// Recording for hp::deferred_init: a boxed fallback on LibTorch's reserved DeferredInit
// dispatch key (reached only while a recording adds that key to this thread's included
// set) runs each operator on the meta device and writes it into the record.
#include "hyperparallel/deferred_init.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "deferred_init_engine.h"
#include "deferred_log.h"

namespace hp {
namespace detail {
namespace {

// The record this thread writes into, while a DeferredInitRecording is alive.
thread_local std::shared_ptr<DeferredLog> active_log;

std::string name_of(const c10::OperatorHandle& op) { return c10::toString(op.operator_name()); }

// Calls fn(tensor, position) for each defined tensor of an argument or return: position
// -1 for a lone tensor, else its index in a list.
template <typename Fn>
void for_each_tensor(const c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) fn(value.toTensor(), -1);
  } else if (value.isTensorList()) {
    const auto list = value.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor t = list.get(i);
      if (t.defined()) fn(t, static_cast<int64_t>(i));
    }
  } else if (value.isOptionalTensorList()) {
    const auto list = value.toOptionalTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      const std::optional<at::Tensor> t = list.get(i);
      if (t && t->defined()) fn(*t, static_cast<int64_t>(i));
    }
  }
}

// `value` with each defined tensor replaced by fn(tensor, position); lists are copied,
// never changed in place (the caller may still hold them).
template <typename Fn>
c10::IValue map_tensors(const c10::IValue& value, Fn&& fn) {
  if (value.isTensor()) {
    return value.toTensor().defined() ? c10::IValue(fn(value.toTensor(), -1)) : value;
  }
  if (value.isTensorList()) {
    auto list = value.toTensorList().copy();
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor t = list.get(i);
      if (t.defined()) list.set(i, fn(t, static_cast<int64_t>(i)));
    }
    return list;
  }
  if (value.isOptionalTensorList()) {
    auto list = value.toOptionalTensorList().copy();
    for (size_t i = 0; i < list.size(); ++i) {
      const std::optional<at::Tensor> t = list.get(i);
      if (t && t->defined()) list.set(i, fn(*t, static_cast<int64_t>(i)));
    }
    return list;
  }
  return value;
}

bool is_kind(c10::TypePtr type, c10::TypeKind kind) {
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == kind;
}

bool returns_tensor(const c10::FunctionSchema& schema) {
  return std::any_of(schema.returns().begin(), schema.returns().end(), [](const auto& r) {
    if (is_kind(r.type(), c10::TypeKind::TensorType)) return true;
    auto list = r.type()->template cast<c10::ListType>();
    return list && is_kind(list->getElementType(), c10::TypeKind::TensorType);
  });
}

bool draws_random(const c10::OperatorHandle& op) {
  const auto& arguments = op.schema().arguments();
  return op.hasTag(at::Tag::nondeterministic_seeded) ||
         std::any_of(arguments.begin(), arguments.end(),
                     [](const auto& a) { return is_kind(a.type(), c10::TypeKind::GeneratorType); });
}

// In-place ops that set every element of their first argument without reading it.
bool overwrites_self(const c10::OperatorHandle& op) {
  static const char* const kNames[] = {
      "aten::uniform_",    "aten::normal_",      "aten::random_",    "aten::cauchy_",
      "aten::log_normal_", "aten::exponential_", "aten::geometric_", "aten::bernoulli_",
      "aten::fill_",       "aten::zero_",        "aten::copy_"};
  const std::string& name = op.schema().name();
  return std::any_of(std::begin(kNames), std::end(kNames),
                     [&](const char* candidate) { return name == candidate; });
}

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.has_storage() ? t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()
                         : nullptr;
}

// Whether `t` is the only tensor on its storage and spans all of it, so that a full
// overwrite of t makes the storage's earlier contents unobservable.
bool sole_owner_of_storage(const at::Tensor& t) {
  return t.has_storage() && t.storage().use_count() == 1 && t.storage_offset() == 0 &&
         t.is_non_overlapping_and_dense() &&
         static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
}

struct DeferredInput {
  size_t arg;
  int64_t position;
  at::Tensor tensor;
  ValueId value;
  c10::Device device;
};

[[noreturn]] void throw_reads_values(const c10::OperatorHandle& op) {
  throw std::logic_error(
      "hp::deferred_init: " + name_of(op) +
      " reads the values of a deferred tensor, which has none until hp::materialize(). "
      "Construction code under deferred_init must not read tensor values (item(), equal(), "
      "nonzero(), boolean masks, data_ptr()); move that code after materialize(), or compute "
      "it from real tensors.");
}

// Runs `op` (its arguments on top of `stack`) on the meta device, writes it into `log`,
// and leaves deferred tensors for its results on the stack.
void record(const c10::OperatorHandle& op, const std::shared_ptr<DeferredLog>& owner,
            torch::jit::Stack& stack, bool factory) {
  DeferredLog& log = *owner;
  const c10::FunctionSchema& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t num_args = arguments.size();
  const auto args = torch::jit::last(stack, num_args);

  std::vector<DeferredInput> deferred;
  std::optional<c10::Device> explicit_device, real_device;
  for (size_t i = 0; i < num_args; ++i) {
    if (args[i].isDevice() && !explicit_device) explicit_device = args[i].toDevice();
    for_each_tensor(args[i], [&](const at::Tensor& t, int64_t position) {
      if (const DeferredTensorImpl* impl = pending_deferred(t)) {
        deferred.push_back({i, position, t, impl->pending()->value, impl->pending()->device});
      } else if (!real_device && !t.is_meta()) {
        real_device = t.device();
      }
    });
  }
  if (!deferred.empty() && op.hasTag(at::Tag::data_dependent_output)) throw_reads_values(op);
  // Where the results would live in an eager run.
  const c10::Device device = explicit_device     ? *explicit_device
                             : !deferred.empty() ? deferred.front().device
                                                 : real_device.value_or(c10::Device(c10::kCPU));

  RecordedOp recorded(op);
  recorded.draws_random = draws_random(op);
  for (size_t i = 0; i < num_args; ++i) {
    const auto* alias = arguments[i].alias_info();
    if (!alias || !alias->isWrite()) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t, int64_t) {
      if (!pending_deferred(t)) {
        throw std::logic_error("hp::deferred_init: " + name_of(op) +
                               " would write values computed from deferred tensors into a "
                               "real tensor, which cannot wait for materialize(); make the "
                               "destination inside the construction too");
      }
      recorded.written_groups.push_back(log.group_of[pending_deferred(t)->pending()->value]);
    });
  }
  if (overwrites_self(op) && !deferred.empty() && deferred.front().arg == 0 &&
      deferred.front().position == -1 && arguments[0].alias_info() &&
      arguments[0].alias_info()->isWrite() && sole_owner_of_storage(deferred.front().tensor)) {
    const at::Tensor& self = deferred.front().tensor;
    const GroupId group = log.group_of[deferred.front().value];
    const bool read_elsewhere =
        std::any_of(deferred.begin() + 1, deferred.end(),
                    [&](const DeferredInput& d) { return log.group_of[d.value] == group; });
    if (!read_elsewhere) {
      recorded.overwrite =
          Overwrite{deferred.front().value, self.sizes().vec(), self.strides().vec(),
                    at::TensorOptions().dtype(self.dtype()).device(device)};
    }
  }
  for (const DeferredInput& d : deferred) {
    if (!(recorded.overwrite && d.value == recorded.overwrite->value && d.arg == 0)) {
      recorded.reads.push_back(d.value);
    }
  }

  // The record keeps the arguments as given (real devices, real tensors); the meta run
  // gets meta devices and meta stand-ins for real tensors.
  torch::jit::Stack meta_args;
  for (size_t i = 0; i < num_args; ++i) {
    RecordedArg arg;
    arg.value = map_tensors(args[i], [&](const at::Tensor& t, int64_t position) -> at::Tensor {
      const DeferredTensorImpl* impl = pending_deferred(t);
      if (!impl) return t;
      arg.deferred.emplace_back(position, impl->pending()->value);
      return at::Tensor();
    });
    recorded.args.push_back(std::move(arg));

    c10::IValue meta = args[i];
    if (is_kind(arguments[i].type(), c10::TypeKind::DeviceObjType)) {
      // A factory without a device would make a real CPU tensor.
      if (factory || !meta.isNone()) meta = c10::Device(c10::kMeta);
    } else if (arguments[i].name() == "pin_memory" && !meta.isNone()) {
      meta = false;  // meta tensors cannot be pinned
    } else {
      meta = map_tensors(meta, [](const at::Tensor& t, int64_t) {
        return pending_deferred(t) ? t : t.to(at::kMeta);
      });
    }
    meta_args.push_back(std::move(meta));
  }
  try {
    // Autograd stays out: outputs must be plain tensors (no view or history metadata)
    // to become deferred tensors; replay runs under NoGradGuard anyway.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(meta_args);
  } catch (const c10::Error& error) {
    throw std::logic_error("hp::deferred_init: " + name_of(op) +
                           " failed on deferred (meta) tensors: " + error.what_without_backtrace() +
                           ". Deferred tensors have shapes but no values until "
                           "hp::materialize(): construction code must not read tensor values "
                           "(item(), nonzero(), ...); move such code after materialize().");
  }

  // Results that are new tensors become new values; a view joins the alias group of the
  // tensor whose storage it shares.
  std::unordered_map<const c10::StorageImpl*, GroupId> groups;
  for (const DeferredInput& d : deferred) {
    if (const auto* storage = storage_of(d.tensor)) groups.emplace(storage, log.group_of[d.value]);
  }
  std::vector<c10::IValue> results;
  for (const c10::IValue& result : meta_args) {
    DeferredSlots made;
    results.push_back(map_tensors(result, [&](const at::Tensor& t, int64_t position) {
      for (const DeferredInput& d : deferred) {
        if (d.tensor.is_same(t)) return t;  // an input returned as it was (in-place)
      }
      GroupId group;
      const c10::StorageImpl* storage = storage_of(t);
      auto found = storage ? groups.find(storage) : groups.end();
      if (found != groups.end()) {
        group = found->second;
      } else {
        group = log.new_group();
        if (storage) groups.emplace(storage, group);
      }
      const ValueId value = log.new_value(group);
      made.emplace_back(position, value);
      return make_deferred(t, DeferredValue{owner, value, device});
    }));
    recorded.outputs.push_back(std::move(made));
  }

  const bool made_values = std::any_of(recorded.outputs.begin(), recorded.outputs.end(),
                                       [](const auto& made) { return !made.empty(); });
  if (made_values || !recorded.written_groups.empty()) {
    if (recorded.draws_random && device.type() != c10::kMeta) log.generators.add(device);
    log.ops.push_back(std::move(recorded));
  }
  torch::jit::drop(stack, num_args);
  for (auto& result : results) stack.push_back(std::move(result));
}

// Every operator call while recording lands here.
void record_or_run(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  // Inner calls (a composite op's parts, the meta run) are not recorded again.
  c10::impl::ExcludeDispatchKeyGuard no_recording(c10::DispatchKey::DeferredInit);
  const std::shared_ptr<DeferredLog> log = active_log;
  bool any_tensor = false, any_deferred = false;
  for (const auto& arg : torch::jit::last(*stack, op.schema().arguments().size())) {
    for_each_tensor(arg, [&](const at::Tensor& t, int64_t) {
      any_tensor = true;
      const DeferredTensorImpl* impl = pending_deferred(t);
      if (!impl) return;
      any_deferred = true;
      if (log && impl->pending()->log != log) {
        throw std::logic_error("hp::deferred_init: " + name_of(op) +
                               " uses a tensor deferred by an earlier deferred_init call; "
                               "construct everything that uses it in one deferred_init call, "
                               "or materialize it first");
      }
    });
  }
  const bool factory = !any_tensor && returns_tensor(op.schema());
  if (!log || (!any_deferred && !factory)) {
    op.callBoxed(stack);  // real tensors only: real work, not recorded
    return;
  }
  record(op, log, *stack, factory);
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&record_or_run>());
}

}  // namespace

struct DeferredInitRecording::State {
  c10::impl::IncludeDispatchKeyGuard recording{c10::DispatchKey::DeferredInit};
};

DeferredInitRecording::DeferredInitRecording() {
  if (active_log) return;  // nested: the outer recording goes on
  active_log = std::make_shared<DeferredLog>();
  state_ = std::make_unique<State>();
}

DeferredInitRecording::~DeferredInitRecording() {
  if (!state_) return;
  state_.reset();
  active_log.reset();  // the deferred tensors keep the record alive
}

std::optional<c10::Device> deferred_device(const at::Tensor& tensor) {
  if (const DeferredTensorImpl* impl = pending_deferred(tensor)) return impl->pending()->device;
  if (tensor.defined() && tensor.is_meta()) {
    throw std::invalid_argument(
        "a meta tensor of shape " + c10::str(tensor.sizes()) +
        " that hp::deferred_init did not make: nothing records how to compute its values. "
        "Construct the module inside hp::deferred_init(...), or on a real device");
  }
  return std::nullopt;
}

void mark_materialized(const at::Tensor& tensor) {
  if (DeferredTensorImpl* impl = pending_deferred(tensor)) impl->mark_materialized();
}

}  // namespace detail

bool is_deferred(const at::Tensor& tensor) { return detail::pending_deferred(tensor) != nullptr; }

}  // namespace hp
