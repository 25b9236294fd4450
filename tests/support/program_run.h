#pragma once
// Runs a program to completion through /bin/sh and keeps what it printed: for tests of
// the command-line programs (hp-run, the trainer).

#include <sys/wait.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace hp::testing {

struct ProgramRun {
  int exit_code = -1;  // 128 + N when killed by signal N
  std::string output;  // stdout and stderr
};

inline ProgramRun run_program(const std::string& command_line) {
  FILE* pipe = popen((command_line + " 2>&1").c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed");
  ProgramRun run;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) {
    run.output.append(buffer, n);
  }
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return run;
}

}  // namespace hp::testing
