#pragma once
// The torchrun-compatible launch environment of this process.

#include <cstdint>
#include <string>

namespace hp {

struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;

  // Reads RANK, WORLD_SIZE, LOCAL_RANK (optional, defaults to RANK), MASTER_ADDR and
  // MASTER_PORT. Throws std::invalid_argument naming the variable and the fix when one
  // is missing or invalid.
  static LaunchEnv from_environment();
};

}  // namespace hp
