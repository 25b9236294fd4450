#pragma once
// The message of the std::exception a call throws, for tests of error reporting; for a
// c10::Error, without the C++ backtrace its what() appends.

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>

namespace hp::testing {

// "no error" when the call returns normally; an exception that is not an E propagates.
template <typename E = std::exception>
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const E& error) {
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
      return c10_error->what_without_backtrace();
    }
    return error.what();
  }
  return "no error";
}

}  // namespace hp::testing
