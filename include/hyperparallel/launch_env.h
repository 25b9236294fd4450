#pragma once
// The torchrun-compatible launch environment of this process.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace hp {

struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // HP_TIMEOUT_S (seconds, may be fractional): how long start-up and collectives wait
  // for the other ranks. Unset: WorldOptions decides (5 minutes by default).
  std::optional<std::chrono::milliseconds> timeout;
  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher (torchrun's agent, hp-run) already hosts
  // the TCPStore on MASTER_PORT, so every rank (rank 0 too) connects to it as a client.
  bool agent_store = false;
  // TORCHELASTIC_RESTART_COUNT: which attempt this is (0 for the first, or when unset).
  int64_t restart_count = 0;

  // Reads RANK, WORLD_SIZE, LOCAL_RANK (optional, defaults to RANK), MASTER_ADDR,
  // MASTER_PORT and the optional HP_TIMEOUT_S, TORCHELASTIC_USE_AGENT_STORE,
  // and TORCHELASTIC_RESTART_COUNT. Throws c10::ValueError naming the
  // variable and the fix when one is missing or invalid.
  static LaunchEnv from_environment();
};

}  // namespace hp
