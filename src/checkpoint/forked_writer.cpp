#include "forked_writer.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>

#include "../distributed/error_message.h"

namespace hp::detail {
namespace {

void write_fully(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the parent is gone: nobody to tell
    done += static_cast<size_t>(n);
  }
}

std::string read_fully(int fd) {
  std::string text;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return text;
    text.append(buffer, static_cast<size_t>(n));
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// The child: waits for the parent's go, writes, exits without running the parent's
// destructors or atexit handlers (they belong to the parent's threads and resources).
[[noreturn]] void run_child(pid_t parent, int go_fd, int result_fd,
                            const std::function<void()>& write_file) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // the parent died before the line above
  char go = 0;
  ssize_t n = 0;
  do {
    n = ::read(go_fd, &go, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) ::_exit(0);  // not let write: the save ended before this rank's turn
  try {
    write_file();
  } catch (const std::exception& error) {
    write_fully(result_fd, message_of(error));
    ::_exit(1);
  }
  ::_exit(0);
}

}  // namespace

ForkedWriter::ForkedWriter(std::function<void()> write_file, std::string what)
    : what_(std::move(what)) {
  int go[2], result[2];
  if (::pipe2(go, O_CLOEXEC) != 0) {
    C10_THROW_ERROR(Error,
                    "cannot start the writer of " + what_ + ": pipe: " + std::strerror(errno));
  }
  if (::pipe2(result, O_CLOEXEC) != 0) {
    const int error = errno;
    ::close(go[0]);
    ::close(go[1]);
    C10_THROW_ERROR(Error,
                    "cannot start the writer of " + what_ + ": pipe: " + std::strerror(error));
  }
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::close(go[1]);
    ::close(result[0]);
    run_child(parent, go[0], result[1], write_file);
  }
  const int fork_error = errno;
  ::close(go[0]);
  ::close(result[1]);
  go_fd_ = go[1];
  result_fd_ = result[0];
  if (pid_ < 0) {
    close_fd(go_fd_);
    close_fd(result_fd_);
    C10_THROW_ERROR(Error, "cannot start the writer of " + what_ +
                               ": fork: " + std::strerror(fork_error) +
                               " (too many processes or too little memory; use "
                               "CheckpointStaging::kCopy)");
  }
}

ForkedWriter::~ForkedWriter() {
  close_fd(go_fd_);  // a child still waiting reads end-of-file and exits
  close_fd(result_fd_);
  if (pid_ > 0) {
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

void ForkedWriter::write() {
  write_fully(go_fd_, "w");
  close_fd(go_fd_);
  const std::string message = read_fully(result_fd_);
  close_fd(result_fd_);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  if (!message.empty()) C10_THROW_ERROR(Error, message);
  C10_THROW_ERROR(Error, "the process writing " + what_ + " " +
                             (WIFSIGNALED(status)
                                  ? "was killed by signal " + std::to_string(WTERMSIG(status))
                                  : "exited with status " + std::to_string(WEXITSTATUS(status))));
}

}  // namespace hp::detail
