#include "distributed_test.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "hyperparallel/collectives.h"
#include "launcher/launcher.h"

namespace hp::testing {
namespace {

constexpr const char* kChildVariable = "HP_DIST_TEST_CHILD";  // "<test>/<world size>"
constexpr const char* kBodyDone = "[hp-dist-test: rank body completed]";
// Followed by the reason, when the body skipped itself (GTEST_SKIP): the parent then
// reports the test as skipped, not passed.
constexpr const char* kBodySkipped = "[hp-dist-test: rank body skipped]";

// The message of the body's GTEST_SKIP.
std::string skip_reason() {
  const ::testing::TestResult* result =
      ::testing::UnitTest::GetInstance()->current_test_info()->result();
  for (int i = 0; i < result->total_part_count(); ++i) {
    if (result->GetTestPartResult(i).skipped()) return result->GetTestPartResult(i).message();
  }
  return "";
}

std::string self_executable() {
  char path[4096];
  ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  return std::string(path, static_cast<size_t>(length));
}

std::chrono::milliseconds test_timeout(int requested_seconds) {
  if (requested_seconds > 0) return std::chrono::seconds(requested_seconds);
  const char* text = std::getenv("HP_DIST_TEST_TIMEOUT");
  int seconds = text ? std::atoi(text) : 60;
  return std::chrono::seconds(seconds > 0 ? seconds : 60);
}

// Set once the body joined its world.
std::shared_ptr<World>& joined_world() {
  static std::shared_ptr<World> joined;
  return joined;
}

void run_as_rank(void (*body)()) {
  at::set_num_threads(1);  // ranks share the machine's few cores
  try {
    body();
    // A rank that exits while others still connect a group to it (Gloo's rendezvous is
    // not over for them) makes them fail with "Connection closed by peer".
    if (joined_world() && !::testing::Test::HasFailure()) {
      barrier(*joined_world()->world_group()).wait();
    }
    // NCCL's communicators are destroyed now, while CUDA is up: at exit, after CUDA's
    // teardown began, ProcessGroupNCCL's destructor would abort the process.
    if (joined_world()) joined_world()->shutdown();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "uncaught exception: " << error.what();
  }
  // The parent requires this marker so that a rank which skipped the body (filter
  // mismatch, early exit) can never count as a pass.
  if (!::testing::Test::HasFailure()) std::printf("%s\n", kBodyDone);
  if (::testing::Test::IsSkipped()) std::printf("%s %s\n", kBodySkipped, skip_reason().c_str());
  std::fflush(stdout);
}

}  // namespace

std::shared_ptr<World> world() {
  if (!joined_world()) {
    if (!std::getenv(kChildVariable)) {
      throw std::logic_error("hp::testing::world() is only available inside HP_DIST_TEST");
    }
    joined_world() = default_world();
  }
  return joined_world();
}

void run_distributed(const char* test_name, int world_size, void (*body)(), int timeout_seconds) {
  const std::string tag = std::string(test_name) + "/" + std::to_string(world_size);
  if (const char* child = std::getenv(kChildVariable)) {
    if (tag == child) run_as_rank(body);
    return;
  }
  LaunchOptions options;
  options.nprocs = world_size;
  options.command = {self_executable(), std::string("--gtest_filter=") + test_name};
  options.extra_env[kChildVariable] = tag;
  options.extra_env["OMP_NUM_THREADS"] = "1";
  options.timeout = test_timeout(timeout_seconds);
  options.prefix_output = false;
  LaunchResult result = launch_local(options);
  if (result.timed_out) {
    ADD_FAILURE() << test_name << " on " << world_size << " ranks timed out after "
                  << options.timeout.count() / 1000 << " s; all ranks were killed";
  }
  size_t skipped = 0;
  std::string reason;
  for (const RankResult& rank : result.ranks) {
    const size_t marker = rank.output.find(kBodySkipped);
    if (marker == std::string::npos) continue;
    ++skipped;
    const size_t begin = marker + std::strlen(kBodySkipped) + 1;
    reason = rank.output.substr(begin, rank.output.find('\n', begin) - begin);
  }
  for (const RankResult& rank : result.ranks) {
    const bool completed = rank.output.find(kBodyDone) != std::string::npos;
    if (rank.exit_code == 0 && completed) continue;
    if (rank.killed_by_launcher && !result.timed_out) continue;  // collateral of another rank
    ADD_FAILURE() << "rank " << rank.rank << " of " << world_size
                  << (completed ? "" : " did not complete the test body") << ", exit code "
                  << rank.exit_code << ". Its output:\n"
                  << rank.output;
  }
  if (!result.ranks.empty() && skipped == result.ranks.size() && !::testing::Test::HasFailure()) {
    GTEST_SKIP() << reason;
  }
}

}  // namespace hp::testing
