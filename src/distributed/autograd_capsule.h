#pragma once
// A value that is not a tensor, carried through an autograd function: as an argument of
// apply() and in the context's saved_data, which holds IValues only (a capsule).

#include <ATen/core/ivalue.h>

#include <utility>

namespace hp::detail {

template <typename T>
struct AutogradCapsule : torch::CustomClassHolder {
  explicit AutogradCapsule(T held) : value(std::move(held)) {}
  T value;

  // The value a capsule saved in a context holds (alive while the context is).
  static T& in(const c10::IValue& saved) {
    return static_cast<AutogradCapsule*>(saved.toCapsule().get())->value;
  }
};

}  // namespace hp::detail
