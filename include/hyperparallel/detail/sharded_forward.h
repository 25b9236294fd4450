#pragma once
// Internals of hp::Sharded (fully_shard.h) that must be in a header because Sharded is a
// template: the forward hooks it calls, and finding the tensors in forward arguments and
// results. Not part of the API.

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace hp {

class FSDPModule;
namespace detail {
class FSDPState;
}

namespace detail {

// The fully_shard forward hooks around one call of a module; inactive (and free) for a
// module that was not fully_shard-ed. If forward throws after before(), the destructor
// reshards what the call gathered, so the next forward starts afresh.
class ForwardHooks {
 public:
  explicit ForwardHooks(const torch::nn::Module* module);
  ~ForwardHooks();
  ForwardHooks(const ForwardHooks&) = delete;
  ForwardHooks& operator=(const ForwardHooks&) = delete;

  bool active() const { return state_ != nullptr; }
  // Pre-forward: unshards (or waits for the prefetch), casts the inputs; undoes itself
  // if it throws.
  void before(const std::vector<at::Tensor*>& inputs);
  // Post-forward: reshards as configured, casts the outputs and hooks them for backward.
  void after(const std::vector<at::Tensor*>& outputs);

 private:
  std::shared_ptr<FSDPState> state_;
  bool forward_running_ = false;
};

// The FSDP interface of a module; throws c10::Error if it was not fully_shard-ed.
FSDPModule fsdp_module_of(const torch::nn::Module* module);

template <typename T>
struct is_vector : std::false_type {};
template <typename T, typename A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <typename T>
struct is_tuple : std::false_type {};
template <typename... T>
struct is_tuple<std::tuple<T...>> : std::true_type {};
template <typename A, typename B>
struct is_tuple<std::pair<A, B>> : std::true_type {};
template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};

// Whether every tensor inside a T is reachable by collect_tensors: tensors, the
// containers it walks, and values that hold no tensor (numbers, enums, strings).
template <typename T>
constexpr bool tensors_are_visible();
template <typename T>
struct elements_are_visible : std::false_type {};
template <typename... E>
struct elements_are_visible<std::tuple<E...>>
    : std::bool_constant<(tensors_are_visible<std::remove_cvref_t<E>>() && ...)> {};
template <typename A, typename B>
struct elements_are_visible<std::pair<A, B>>
    : std::bool_constant<tensors_are_visible<std::remove_cvref_t<A>>() &&
                         tensors_are_visible<std::remove_cvref_t<B>>()> {};
template <typename T>
constexpr bool tensors_are_visible() {
  if constexpr (std::is_same_v<T, at::Tensor> || std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                std::is_same_v<T, std::string>) {
    return true;
  } else if constexpr (is_vector<T>::value || is_optional<T>::value) {
    return tensors_are_visible<typename T::value_type>();
  } else {
    return elements_are_visible<T>::value;
  }
}

// Collects pointers to the tensors inside forward arguments / results.
template <typename T>
void collect_tensors(T& value, std::vector<at::Tensor*>& out) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    out.push_back(&value);
  } else if constexpr (is_vector<T>::value) {
    for (auto& element : value) collect_tensors(element, out);
  } else if constexpr (is_tuple<T>::value) {
    std::apply([&](auto&... element) { (collect_tensors(element, out), ...); }, value);
  } else if constexpr (is_optional<T>::value) {
    if (value) collect_tensors(*value, out);
  }
}

}  // namespace detail

}  // namespace hp
