// Recording for hp::deferred_init: a boxed fallback on LibTorch's reserved DeferredInit
// dispatch key (reached only while a recording adds that key to this thread's included
// set) runs each operator on the meta device and writes it into the record.
#include "hyperparallel/deferred_init.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
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

// The deferred tensors among an op's arguments, and the device its results would have in
// an eager run: an explicit device argument, else the first deferred input's, else the
// first real input's, else the CPU.
struct OpInputs {
  std::vector<DeferredInput> deferred;
  c10::Device device{c10::kCPU};
};

OpInputs inspect_inputs(c10::ArrayRef<c10::IValue> args) {
  OpInputs inputs;
  std::optional<c10::Device> explicit_device, real_device;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].isDevice() && !explicit_device) explicit_device = args[i].toDevice();
    for_each_tensor(args[i], [&](const at::Tensor& t, int64_t position) {
      if (const DeferredTensorImpl* impl = pending_deferred(t)) {
        inputs.deferred.push_back(
            {i, position, t, impl->pending()->value, impl->pending()->device});
      } else if (!real_device && !t.is_meta()) {
        real_device = t.device();
      }
    });
  }
  if (explicit_device) {
    inputs.device = *explicit_device;
  } else if (!inputs.deferred.empty()) {
    inputs.device = inputs.deferred.front().device;
  } else if (real_device) {
    inputs.device = *real_device;
  }
  return inputs;
}

[[noreturn]] void throw_reads_values(const c10::OperatorHandle& op) {
  C10_THROW_ERROR(
      Error,
      "hp::deferred_init: " + name_of(op) +
          " reads the values of a deferred tensor, which has none until hp::materialize(). "
          "Construction code under deferred_init must not read tensor values (item(), equal(), "
          "nonzero(), boolean masks, data_ptr()); move that code after materialize(), or compute "
          "it from real tensors.");
}

// The alias groups `op` writes in place (arguments annotated Tensor(a!)).
std::vector<GroupId> written_groups(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                    const DeferredLog& log) {
  std::vector<GroupId> groups;
  const auto& arguments = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (!alias || !alias->isWrite()) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t, int64_t) {
      const DeferredTensorImpl* impl = pending_deferred(t);
      if (!impl) {
        C10_THROW_ERROR(Error, "hp::deferred_init: " + name_of(op) +
                                   " would write values computed from deferred tensors into a "
                                   "real tensor, which cannot wait for materialize(); make the "
                                   "destination inside the construction too");
      }
      groups.push_back(log.group_of[impl->pending()->value]);
    });
  }
  return groups;
}

// Set when `op` replaces every element of its first argument, a deferred tensor that is
// alone on its storage and that the op reads nowhere else.
std::optional<Overwrite> whole_overwrite(const c10::OperatorHandle& op, const OpInputs& inputs,
                                         const DeferredLog& log) {
  const auto& arguments = op.schema().arguments();
  if (!overwrites_self(op) || inputs.deferred.empty() || arguments.empty()) return std::nullopt;
  const DeferredInput& self = inputs.deferred.front();
  const auto* alias = arguments[0].alias_info();
  if (self.arg != 0 || self.position != -1 || !alias || !alias->isWrite() ||
      !sole_owner_of_storage(self.tensor)) {
    return std::nullopt;
  }
  const GroupId group = log.group_of[self.value];
  for (size_t i = 1; i < inputs.deferred.size(); ++i) {
    if (log.group_of[inputs.deferred[i].value] == group) return std::nullopt;
  }
  return Overwrite{self.value, self.tensor.sizes().vec(), self.tensor.strides().vec(),
                   at::TensorOptions().dtype(self.tensor.dtype()).device(inputs.device)};
}

// The argument as the record keeps it: as given, deferred tensors named by value.
RecordedArg recorded_argument(const c10::IValue& value) {
  RecordedArg arg;
  arg.value = map_tensors(value, [&](const at::Tensor& t, int64_t position) -> at::Tensor {
    const DeferredTensorImpl* impl = pending_deferred(t);
    if (!impl) return t;
    arg.deferred.emplace_back(position, impl->pending()->value);
    return at::Tensor();
  });
  return arg;
}

// The argument for the meta run: meta devices, meta stand-ins for real tensors.
c10::IValue meta_argument(const c10::Argument& argument, const c10::IValue& value, bool factory) {
  if (is_kind(argument.type(), c10::TypeKind::DeviceObjType)) {
    // A factory without a device would make a real CPU tensor.
    return factory || !value.isNone() ? c10::IValue(c10::Device(c10::kMeta)) : value;
  }
  if (argument.name() == "pin_memory" && !value.isNone()) return false;  // meta cannot pin
  return map_tensors(value, [](const at::Tensor& t, int64_t) {
    return pending_deferred(t) ? t : t.to(at::kMeta);
  });
}

void run_on_meta(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  try {
    // Autograd stays out: results must be plain tensors (no view or history metadata)
    // to become deferred tensors; replay runs under NoGradGuard anyway.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(stack);
  } catch (const c10::Error& error) {
    C10_THROW_ERROR(Error,
                    "hp::deferred_init: " + name_of(op) +
                        " failed on deferred (meta) tensors: " + error.what_without_backtrace() +
                        ". Deferred tensors have shapes but no values until "
                        "hp::materialize(): construction code must not read tensor values "
                        "(item(), nonzero(), ...); move such code after materialize().");
  }
}

// Turns the new tensors among an op's meta results into deferred tensors standing for
// new values of `log`; a view joins the alias group of the tensor whose storage it shares.
class ResultWrapper {
 public:
  ResultWrapper(const std::shared_ptr<DeferredLog>& owner, const OpInputs& inputs)
      : owner_(owner), inputs_(inputs) {
    for (const DeferredInput& d : inputs.deferred) {
      if (const auto* storage = storage_of(d.tensor)) {
        groups_.emplace(storage, owner->group_of[d.value]);
      }
    }
  }

  // `result` with its new tensors wrapped; their values are added to `made`.
  c10::IValue wrap(const c10::IValue& result, DeferredSlots& made) {
    return map_tensors(result, [&](const at::Tensor& t, int64_t position) {
      for (const DeferredInput& d : inputs_.deferred) {
        if (d.tensor.is_same(t)) return t;  // an input returned as it was (in-place)
      }
      const ValueId value = owner_->new_value(group_of(t));
      made.emplace_back(position, value);
      return make_deferred(t, DeferredValue{owner_, value, inputs_.device});
    });
  }

 private:
  GroupId group_of(const at::Tensor& t) {
    const c10::StorageImpl* storage = storage_of(t);
    if (!storage) return owner_->new_group();
    auto found = groups_.find(storage);
    if (found != groups_.end()) return found->second;
    return groups_.emplace(storage, owner_->new_group()).first->second;
  }

  const std::shared_ptr<DeferredLog>& owner_;
  const OpInputs& inputs_;
  std::unordered_map<const c10::StorageImpl*, GroupId> groups_;
};

// Runs `op` (its arguments on top of `stack`) on the meta device, writes it into the
// record, and leaves deferred tensors for its results on the stack.
void record(const c10::OperatorHandle& op, const std::shared_ptr<DeferredLog>& owner,
            torch::jit::Stack& stack, bool factory) {
  DeferredLog& log = *owner;
  const auto& arguments = op.schema().arguments();
  const size_t num_args = arguments.size();
  const auto args = torch::jit::last(stack, num_args);

  const OpInputs inputs = inspect_inputs(args);
  if (!inputs.deferred.empty() && op.hasTag(at::Tag::data_dependent_output)) {
    throw_reads_values(op);
  }
  RecordedOp recorded(op);
  recorded.draws_random = draws_random(op);
  recorded.written_groups = written_groups(op, args, log);
  recorded.overwrite = whole_overwrite(op, inputs, log);
  for (const DeferredInput& d : inputs.deferred) {
    const bool overwritten =
        recorded.overwrite && d.arg == 0 && d.value == recorded.overwrite->value;
    if (!overwritten) recorded.reads.push_back(d.value);
  }

  torch::jit::Stack meta_stack;
  for (size_t i = 0; i < num_args; ++i) {
    recorded.args.push_back(recorded_argument(args[i]));
    meta_stack.push_back(meta_argument(arguments[i], args[i], factory));
  }
  run_on_meta(op, meta_stack);

  ResultWrapper wrapper(owner, inputs);
  std::vector<c10::IValue> results;
  for (const c10::IValue& result : meta_stack) {
    DeferredSlots made;
    results.push_back(wrapper.wrap(result, made));
    recorded.outputs.push_back(std::move(made));
  }

  // An op that made no new value and wrote nothing (e.g. a size query) changes nothing
  // materialize() would need.
  const bool made_values = std::any_of(recorded.outputs.begin(), recorded.outputs.end(),
                                       [](const auto& made) { return !made.empty(); });
  if (made_values || !recorded.written_groups.empty()) {
    if (recorded.draws_random && inputs.device.type() != c10::kMeta) {
      log.generators.add(inputs.device);
    }
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
        C10_THROW_ERROR(Error, "hp::deferred_init: " + name_of(op) +
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
    C10_THROW_ERROR(
        ValueError,
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
