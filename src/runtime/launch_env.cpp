#include "hyperparallel/launch_env.h"

#include <cstdlib>
#include <stdexcept>

namespace hp {
namespace {

constexpr const char* kHowToLaunch =
    "; start the program with `hp-run -n N -- prog` or `torchrun --no-python "
    "--nproc-per-node N prog`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";

std::string required(const char* name) {
  const char* value = std::getenv(name);
  if (!value || !*value) {
    throw std::invalid_argument(std::string("environment variable ") + name + " is not set" +
                                kHowToLaunch);
  }
  return value;
}

int64_t parse_int(const char* name, const std::string& text, int64_t min, int64_t max) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < min || value > max) {
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + text +
                                "' is not an integer in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "]" + kHowToLaunch);
  }
  return value;
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  env.world_size = parse_int("WORLD_SIZE", required("WORLD_SIZE"), 1, 1 << 20);
  env.rank = parse_int("RANK", required("RANK"), 0, env.world_size - 1);
  const char* local = std::getenv("LOCAL_RANK");
  env.local_rank =
      local && *local ? parse_int("LOCAL_RANK", local, 0, env.world_size - 1) : env.rank;
  env.master_addr = required("MASTER_ADDR");
  env.master_port = static_cast<int>(parse_int("MASTER_PORT", required("MASTER_PORT"), 1, 65535));
  return env;
}

}  // namespace hp
