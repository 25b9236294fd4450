#pragma once
// A child process that writes from a snapshot: fork() gives it this process's memory as
// it is at the fork, copy-on-write, so the parent may change its tensors right away while
// the child writes them as they were (the kernel copies only the pages the parent writes
// to meanwhile). The child dies with its parent (PR_SET_PDEATHSIG), so a killed rank
// leaves no writer behind.

#include <sys/types.h>

#include <functional>
#include <string>

namespace hp::detail {

class ForkedWriter {
 public:
  // Forks now. The child waits until write() lets it run `write_file`, which must touch
  // only CPU memory and files (no collectives, no threads, no GPU). Throws c10::Error
  // when the process cannot fork.
  ForkedWriter(std::function<void()> write_file, std::string what);
  // Ends a child that was never let write (it exits without writing) and reaps it.
  ~ForkedWriter();
  ForkedWriter(const ForkedWriter&) = delete;
  ForkedWriter& operator=(const ForkedWriter&) = delete;

  // Lets the child write and waits for it to exit; throws c10::Error with the child's own
  // message when `write_file` threw, or naming `what` when the child died.
  void write();

 private:
  pid_t pid_ = -1;
  int go_fd_ = -1;      // the parent's end: one byte lets the child write
  int result_fd_ = -1;  // the child's error message, if any
  std::string what_;
};

}  // namespace hp::detail
