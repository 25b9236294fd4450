#pragma once
// A scratch directory that every rank of a multi-rank test names alike (the ranks are
// children of one test process), removed once all ranks are done with it.

#include <unistd.h>

#include <filesystem>
#include <string>

#include "distributed_test.h"
#include "hyperparallel/collectives.h"

namespace hp::testing {

inline std::string shared_dir(const std::string& stem) {
  const auto dir =
      std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(getppid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void remove_after_all_ranks(const std::string& dir) {
  auto group = world();
  barrier(*group->world_group()).wait();
  if (group->rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace hp::testing
