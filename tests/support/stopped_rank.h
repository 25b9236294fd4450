#pragma once
// A rank that stops (SIGSTOP: a frozen process or machine) for the others of a multi-rank
// test to observe, and is resumed once they are done: its pid goes through a file in a
// directory every rank names alike, the others wait until the kernel shows it stopped.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace hp::testing {

class StoppedRank {
 public:
  // `dir`: shared by the ranks (shared_dir); `tag`: apart from other uses of it.
  StoppedRank(std::string dir, std::string tag)
      : pid_file_(std::move(dir) + "/pid_" + tag), tag_(std::move(tag)) {}

  // On the rank to stop: stops it until another rank resumes it.
  void stop_here() const {
    std::ofstream(pid_file_ + ".partial") << getpid();
    std::filesystem::rename(pid_file_ + ".partial", pid_file_);
    raise(SIGSTOP);
  }

  // On the others: returns once the rank is stopped (false after 30 s).
  bool wait_until_stopped() {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!(std::ifstream(pid_file_) >> pid_) || !is_stopped()) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  // On every rank but the stopped one, once done: `resumer` waits until every rank of
  // `others` is done too, then resumes the stopped rank.
  void done(int64_t rank, int64_t resumer, const std::vector<int64_t>& others) const {
    std::ofstream(done_file(rank)) << "";
    if (rank != resumer) return;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (int64_t r : others) {
      while (!std::filesystem::exists(done_file(r))) {
        ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "rank " << r << " did not finish";
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    kill(pid_, SIGCONT);
  }

 private:
  bool is_stopped() const {
    std::ifstream stat("/proc/" + std::to_string(pid_) + "/stat");
    std::string pid_field, name, state;
    stat >> pid_field >> name >> state;  // the program name has no spaces here
    return state == "T";
  }
  std::string done_file(int64_t rank) const { return pid_file_ + "_done_" + std::to_string(rank); }

  std::string pid_file_;
  std::string tag_;
  pid_t pid_ = 0;
};

}  // namespace hp::testing
