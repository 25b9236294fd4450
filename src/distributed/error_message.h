#pragma once
// The message of an exception for another message or the user: c10::Error::what()
// appends a C++ backtrace, which belongs in neither.

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace hp::detail {

inline std::string message_of(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
    return c10_error->what_without_backtrace();
  }
  return error.what();
}

// A distributed failure whose message names what happened (the rank that stopped, the
// store that did not answer) is the whole story: made without a C++ backtrace, so that a
// program that lets it end the process (std::terminate prints what()) prints it alone.
template <typename Failure>
Failure named_failure(std::string message) {
  return Failure(std::move(message));
}

}  // namespace hp::detail
