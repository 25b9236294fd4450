#pragma once
// The message of the std::exception a call throws, for tests of error reporting.

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
    return error.what();
  }
  return "no error";
}

}  // namespace hp::testing
