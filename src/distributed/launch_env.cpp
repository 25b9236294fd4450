#include "hyperparallel/launch_env.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <optional>

namespace hp {
namespace {

constexpr const char* kHowToLaunch =
    "; start the program with `hp-run -n N -- prog` or `torchrun --no-python "
    "--nproc-per-node N prog`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";

std::string required(const char* name) {
  const char* value = std::getenv(name);
  if (!value || !*value) {
    C10_THROW_ERROR(ValueError,
                    std::string("environment variable ") + name + " is not set" + kHowToLaunch);
  }
  return value;
}

// `parse` (std::stoll, std::stod, ...) of the whole of `text`; nothing if it does not
// parse or leaves characters over.
template <typename T>
std::optional<T> parse_whole(const std::string& text, T (*parse)(const std::string&, size_t*)) {
  size_t used = 0;
  try {
    const T value = parse(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

int64_t parse_int(const char* name, const std::string& text, int64_t min, int64_t max) {
  const auto value = parse_whole<long long>(
      text, [](const std::string& t, size_t* used) { return std::stoll(t, used); });
  if (!value || *value < min || *value > max) {
    C10_THROW_ERROR(ValueError, std::string("environment variable ") + name + "='" + text +
                                    "' is not an integer in [" + std::to_string(min) + ", " +
                                    std::to_string(max) + "]" + kHowToLaunch);
  }
  return *value;
}

// A positive number of seconds, e.g. "10" or "0.5".
std::chrono::milliseconds parse_seconds(const char* name, const std::string& text) {
  const auto parsed = parse_whole<double>(
      text, [](const std::string& t, size_t* used) { return std::stod(t, used); });
  const double seconds = parsed.value_or(0);
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 1e7) {
    C10_THROW_ERROR(ValueError, std::string("environment variable ") + name + "='" + text +
                                    "' is not a positive number of seconds (how long start-up and "
                                    "collectives wait for the other ranks, e.g. 60)");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
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
  if (const char* timeout = std::getenv("HP_TIMEOUT_S"); timeout && *timeout) {
    env.timeout = parse_seconds("HP_TIMEOUT_S", timeout);
  }
  // torchrun writes Python's str(bool): "True" or "False".
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE"); agent && *agent) {
    const std::string value = agent;
    if (value != "True" && value != "False" && value != "1" && value != "0") {
      C10_THROW_ERROR(ValueError, "environment variable TORCHELASTIC_USE_AGENT_STORE='" + value +
                                      "' is neither True nor False (torchrun sets it)");
    }
    env.agent_store = value == "True" || value == "1";
  }
  if (const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT"); restart && *restart) {
    env.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", restart, 0, 1 << 30);
  }
  return env;
}

}  // namespace hp
