#pragma once
// Writes past the file-size limit (RLIMIT_FSIZE, `ulimit -f`, set by some batch systems):
// by default the kernel kills the writer with SIGXFSZ, without a word (exit 153). The
// checkpoint writers ignore the signal, so that the write fails with EFBIG instead, and
// name the limit in their error.

#include <signal.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace hp::detail {

// Sets SIGXFSZ to be ignored unless the program handles it (as World does for SIGPIPE).
// Call before writing a file.
inline void let_oversized_writes_fail() {
  struct sigaction current{};
  if (sigaction(SIGXFSZ, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) &&
      current.sa_handler == SIG_DFL) {
    signal(SIGXFSZ, SIG_IGN);
  }
}

// Why a write failed: strerror(error), and for EFBIG the limit and the fix.
inline std::string write_error_text(int error) {
  std::string text = std::strerror(error);
  rlimit limit{};
  if (error == EFBIG && getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    text += " (this process's file-size limit, RLIMIT_FSIZE or `ulimit -f`, is " +
            std::to_string(limit.rlim_cur) +
            " bytes: raise it, e.g. `ulimit -f unlimited` in the job script, or ask the batch "
            "system for a higher one)";
  }
  return text;
}

}  // namespace hp::detail
