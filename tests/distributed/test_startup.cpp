// Start-up and collectives that cannot hang (World::from_env, a late rank): ranks that never start,
// start late, or are pointed at a name that does not resolve or a port another program holds. The
// ranks are tests/world_join processes started here by hand (hp-run would start all of them); every
// case runs with a short HP_TIMEOUT_S, and the others must fail within it, with one line naming the
// missing rank or the variable at fault, and no C++ backtrace.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "launcher/launcher.h"
#include "loopback_listener.h"
#include "program_run.h"

#ifndef WORLD_JOIN_PATH
#error "WORLD_JOIN_PATH must name the world_join executable"
#endif
#ifndef PARTITION_PATH
#error "PARTITION_PATH must name tests/distributed/partition.sh"
#endif

namespace hp::testing {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The shell words that start rank `rank` of `world_size` with `timeout_s`.
std::string rank_command(int rank, int world_size, int port, int timeout_s,
                         const std::string& master_addr = "127.0.0.1") {
  return "env RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world_size) +
         " MASTER_ADDR=" + master_addr + " MASTER_PORT=" + std::to_string(port) +
         " HP_TIMEOUT_S=" + std::to_string(timeout_s) + " " + WORLD_JOIN_PATH;
}

// `background` and `foreground` (shell words) at once: the foreground's output and
// status, once both ended.
std::string both(const std::string& background, const std::string& foreground) {
  return "{ " + background + " & " + foreground + "; status=$?; wait; exit $status; }";
}

struct Timed {
  ProgramRun run;
  double seconds = 0;  // from the start of the rank to its error, -1 if none was printed
};

// world_join's own measure ("failed after S s"): a loaded machine may take seconds to
// start and end a process, which is no part of what is tested.
double failed_after(const std::string& output) {
  std::smatch match;
  return std::regex_search(output, match, std::regex("world_join: failed after ([0-9.]+) s"))
             ? std::stod(match[1])
             : -1;
}

Timed timed(const std::string& command) {
  Timed result{run_program(command), 0};
  result.seconds = failed_after(result.run.output);
  return result;
}

// One line from the library, not LibTorch's "Exception raised from ..." and frames.
void expect_no_backtrace(const std::string& output) {
  EXPECT_FALSE(contains(output, "Exception raised from")) << output;
  EXPECT_FALSE(contains(output, "frame #")) << output;
}

struct TempFile {
  fs::path path = fs::temp_directory_path() /
                  ("hp_startup_" + std::to_string(getpid()) + "_" +
                   std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  ~TempFile() { fs::remove(path); }
  std::string text() const {
    std::ifstream stream(path);
    return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
  }
};

TEST(Startup, RanksThatNeverStartAreNamedWithinTheTimeout) {
  // Ranks 0 and 2 of 3 start; rank 1 never does.
  const int port = find_free_port();
  TempFile rank2;
  const Timed rank0 =
      timed(both(rank_command(2, 3, port, 3) + " > " + rank2.path.string() + " 2>&1",
                 rank_command(0, 3, port, 3)));
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  for (const std::string& output : {rank0.run.output, rank2.text()}) {
    EXPECT_TRUE(contains(output,
                         "world_join: error: start-up join of 3 ranks timed out after 3 s: rank "
                         "1 of 3 did not arrive"))
        << output;
    EXPECT_TRUE(contains(output, "HP_TIMEOUT_S")) << output;
    expect_no_backtrace(output);
    EXPECT_GE(failed_after(output), 2.9) << output;
    EXPECT_LT(failed_after(output), 4.5) << "the timeout is 3 s\n" << output;
  }

  // Rank 0, which hosts the store, never starts.
  const Timed rank1 = timed(rank_command(1, 2, find_free_port(), 3));
  EXPECT_EQ(rank1.run.exit_code, 1) << rank1.run.output;
  EXPECT_TRUE(contains(rank1.run.output, "start-up join: rank 0 did not arrive within 3 s"))
      << rank1.run.output;
  EXPECT_TRUE(contains(rank1.run.output, "MASTER_ADDR=127.0.0.1")) << rank1.run.output;
  expect_no_backtrace(rank1.run.output);
  EXPECT_GE(rank1.seconds, 2.9);
  EXPECT_LT(rank1.seconds, 4.5) << "the timeout is 3 s";
}

// Ranks started with different WORLD_SIZEs are told so, not that a rank is missing: both
// sides, at once (the side whose join cannot complete, waiting for a rank 2 that does not
// exist, learns it from the other; before, only the other side named it).
TEST(Startup, ADifferentWorldSizeIsNamed) {
  const int port = find_free_port();
  TempFile rank1_output;
  const Timed rank0 =
      timed(both(rank_command(1, 3, port, 3) + " > " + rank1_output.path.string() + " 2>&1",
                 rank_command(0, 2, port, 3)));
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  EXPECT_TRUE(contains(rank0.run.output,
                       "world_join: error: start-up join of 2 ranks: rank 1 expects a group of 3 "
                       "ranks, this rank (0) one of 2: start every rank with the same WORLD_SIZE"))
      << rank0.run.output;
  expect_no_backtrace(rank0.run.output);
  EXPECT_LT(rank0.seconds, 2.9) << "at once, not after the timeout (3 s)";
  const std::string rank1 = rank1_output.text();
  EXPECT_TRUE(contains(rank1,
                       "world_join: error: start-up join of 3 ranks: rank 0 expects a group of 2 "
                       "ranks, this rank (1) one of 3: start every rank with the same WORLD_SIZE"))
      << rank1;
  expect_no_backtrace(rank1);
  EXPECT_GE(failed_after(rank1), 0.0) << rank1;
  EXPECT_LT(failed_after(rank1), 2.9) << "at once, not after the timeout (3 s)";
}

// Two processes started with the same RANK: the later one is told so at once, and the
// job of the first one goes on (rank 0, which hosts the store, stays 4 s after the join, so
// that the later one still finds it).
TEST(Startup, ADuplicatedRankIsNamed) {
  const int port = find_free_port();
  TempFile first, second;
  const ProgramRun run =
      run_program("{ " + rank_command(1, 2, port, 10) + " > " + first.path.string() + " 2>&1 & " +
                  rank_command(1, 2, port, 10) + " > " + second.path.string() + " 2>&1 & " +
                  "WORLD_JOIN_SLEEP_S=4 " + rank_command(0, 2, port, 10) +
                  "; status=$?; wait; exit $status; }");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  const std::string message =
      "world_join: error: start-up join of 2 ranks: another process arrived as rank 1 before "
      "this one: start each process with a RANK of its own (0 to WORLD_SIZE - 1)";
  const bool first_refused = contains(first.text(), message);
  EXPECT_NE(first_refused, contains(second.text(), message)) << first.text() << "\n---\n"
                                                             << second.text();
  EXPECT_TRUE(contains(first_refused ? second.text() : first.text(), "rank 1 of 2 joined"))
      << first.text() << "\n---\n"
      << second.text();
  expect_no_backtrace(first.text() + second.text());
}

TEST(Startup, ARankThatGivesUpLaterStillNamesTheMissingRank) {
  // Rank 0 (the store's host) reaches its deadline first; rank 2, started 1 s later,
  // reaches its own while rank 0 waits for it to take the verdict, instead of finding the
  // store gone ("lost the connection").
  const int port = find_free_port();
  TempFile rank2;
  const Timed rank0 = timed(
      both("(sleep 1; " + rank_command(2, 3, port, 3) + " > " + rank2.path.string() + " 2>&1)",
           rank_command(0, 3, port, 3)));
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  for (const std::string& output : {rank0.run.output, rank2.text()}) {
    EXPECT_TRUE(contains(output,
                         "world_join: error: start-up join of 3 ranks timed out after 3 s: rank "
                         "1 of 3 did not arrive"))
        << output;
    expect_no_backtrace(output);
  }
  EXPECT_GE(failed_after(rank2.text()), 2.9) << rank2.text();
}

TEST(Startup, ACollectiveARankDoesNotReachNamesItWithinTheTimeout) {
  // Both join; rank 1 comes to the all-reduce 6 s late, past the 2 s timeout. Rank 0's
  // error names the collective, its group and rank 1 (which never reported a failure of
  // its own in the 2 s rank 0 waited for that).
  const int port = find_free_port();
  const Timed rank0 =
      timed(both("WORLD_JOIN_SLEEP_S=6 " + rank_command(1, 2, port, 2) + " > /dev/null 2>&1",
                 rank_command(0, 2, port, 2)));
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  EXPECT_TRUE(contains(rank0.run.output,
                       "world_join: error: all_reduce #1 over group 'world' "
                       "failed ("))
      << rank0.run.output;
  EXPECT_TRUE(
      contains(rank0.run.output, "; world rank 1 did not report the same failure within 2 s"))
      << rank0.run.output;
  EXPECT_TRUE(contains(rank0.run.output, "HP_TIMEOUT_S")) << rank0.run.output;
  expect_no_backtrace(rank0.run.output);
  EXPECT_GE(rank0.seconds, 3.9) << "the timeout (2 s) and the wait for reports (2 s)";
  EXPECT_LT(rank0.seconds, 5.5) << rank0.run.output;
}

// Rank 0 hosts the store and freezes after the join (SIGSTOP: a stopped or cut-off host):
// rank 1's all-reduce times out, and reporting that in the store must not wait on the frozen
// host for as long as TCP retries. The error comes within the timeout + 3 s and says why.
TEST(Startup, AStoreHostThatStopsAfterStartUpEndsTheOthersWithinTheBound) {
  const int port = find_free_port();
  const Timed rank1 = timed("{ env WORLD_JOIN_STOP=1 " + rank_command(0, 2, port, 2) +
                            " > /dev/null 2>&1 & host=$!; " + rank_command(1, 2, port, 2) +
                            "; status=$?; kill -KILL $host; wait; exit $status; }");
  EXPECT_EQ(rank1.run.exit_code, 1) << rank1.run.output;
  EXPECT_TRUE(contains(rank1.run.output,
                       "world_join: error: all_reduce #1 over group 'world' "
                       "failed ("))
      << rank1.run.output;
  EXPECT_TRUE(contains(rank1.run.output,
                       "; the store did not answer within 3 s: the process that hosts the store "
                       "(hp-run, torchrun's agent, or else rank 0) is stopped, or this machine "
                       "is cut off from it"))
      << rank1.run.output;
  expect_no_backtrace(rank1.run.output);
  std::smatch after_join;  // the host stopped right after the join
  ASSERT_TRUE(
      std::regex_search(rank1.run.output, after_join, std::regex(", ([0-9.]+) s after joining")))
      << rank1.run.output;
  EXPECT_GE(std::stod(after_join[1]), 4.9) << "the timeout (2 s) and the bounded store calls (3 s)";
  EXPECT_LT(std::stod(after_join[1]), 2.0 + 3.0 + 0.5) << rank1.run.output;
}

TEST(Startup, RanksStartingLateWithinTheTimeoutJoin) {
  for (const auto& [first, second] : {std::pair{0, 1}, std::pair{1, 0}}) {
    SCOPED_TRACE("rank " + std::to_string(second) + " starts 2 s after rank " +
                 std::to_string(first));
    const int port = find_free_port();
    TempFile late;
    const ProgramRun run = run_program(both(
        "(sleep 2; " + rank_command(second, 2, port, 20) + " > " + late.path.string() + " 2>&1)",
        rank_command(first, 2, port, 20)));
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(contains(run.output, "of 2 joined: rank sum 1, timeout 20000 ms")) << run.output;
    EXPECT_TRUE(contains(late.text(), "of 2 joined: rank sum 1")) << late.text();
  }
}

TEST(Startup, UnresolvableMasterAddrIsNamedWithinTheTimeout) {
  for (int rank : {0, 1}) {
    const Timed run = timed(rank_command(rank, 2, find_free_port(), 5, "no-such-host.invalid"));
    EXPECT_EQ(run.run.exit_code, 1) << run.run.output;
    EXPECT_TRUE(contains(run.run.output, "MASTER_ADDR='no-such-host.invalid'")) << run.run.output;
    expect_no_backtrace(run.run.output);
    EXPECT_GE(run.seconds, 0) << run.run.output;
    EXPECT_LT(run.seconds, 6.0) << "the timeout is 5 s";
  }
}

TEST(Startup, AForeignListenerOnMasterPortIsNamed) {
  const LoopbackListener listener;
  const int port = listener.port();

  const Timed client = timed(rank_command(1, 2, port, 3));
  EXPECT_EQ(client.run.exit_code, 1) << client.run.output;
  EXPECT_TRUE(contains(client.run.output, "did not answer as a TCPStore within 3 s"))
      << client.run.output;
  EXPECT_TRUE(contains(client.run.output, "another program holds MASTER_PORT"))
      << client.run.output;
  expect_no_backtrace(client.run.output);
  EXPECT_GE(client.seconds, 2.9);
  EXPECT_LT(client.seconds, 4.5) << "the timeout is 3 s";

  const Timed host = timed(rank_command(0, 2, port, 3));
  EXPECT_EQ(host.run.exit_code, 1) << host.run.output;
  EXPECT_TRUE(contains(host.run.output, "rank 0 cannot host the store: MASTER_PORT=" +
                                            std::to_string(port) + " is already in use"))
      << host.run.output;
  EXPECT_GE(host.seconds, 0) << host.run.output;
  EXPECT_LT(host.seconds, 1.0) << "a port in use is known at once";
}

// Ranks started by hand, no launcher: rank 1 is killed (SIGKILL) once it has joined
// (it stops itself there, and the shell kills it when it sees it stopped), while rank 0
// waits in the all-reduce. Rank 0 fails within the timeout + 3 s, naming world rank 1.
TEST(Startup, AKilledRankWithoutALauncherIsNamedWithinTheBound) {
  const int port = find_free_port();
  const Timed rank0 = timed(
      "{ env WORLD_JOIN_STOP=1 " + rank_command(1, 2, port, 2) +
      " > /dev/null 2>&1 & victim=$!; { until ps -o stat= -p $victim | grep -q T; do sleep 0.05; "
      "done; kill -KILL $victim; } & " +
      rank_command(0, 2, port, 2) + "; status=$?; wait; exit $status; }");
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  EXPECT_TRUE(
      contains(rank0.run.output, "world_join: error: all_reduce #1 over group 'world' failed"))
      << rank0.run.output;
  EXPECT_TRUE(contains(rank0.run.output, "world rank 1")) << rank0.run.output;
  expect_no_backtrace(rank0.run.output);
  std::smatch after_join;
  ASSERT_TRUE(
      std::regex_search(rank0.run.output, after_join, std::regex(", ([0-9.]+) s after joining")))
      << rank0.run.output;
  EXPECT_LT(std::stod(after_join[1]), 2.0 + 3.0 + 0.5) << "the timeout (2 s) and 3 s";
}

// Two machines (network namespaces) that lose each other after the join, silently (no
// connection refused): each side's error comes within its bound and says what it saw.
// Rank 0, the store's host, names rank 1 (0.5 s late + the timeout, 2 s + the 2 s report
// window); rank 1 says the store did not answer (1 s late + 2 s + the bounded store
// calls, 3 s). Skipped, with the reason, where namespaces cannot be made.
TEST(Startup, APartitionBetweenTwoMachinesEndsBothSidesWithinTheBound) {
  const ProgramRun run = run_program(std::string(PARTITION_PATH) + " " + WORLD_JOIN_PATH);
  if (run.exit_code == 77) GTEST_SKIP() << run.output;
  ASSERT_TRUE(contains(run.output, "exit codes 1 1")) << run.output;
  EXPECT_TRUE(contains(run.output,
                       "[rank 0] world_join: error: all_reduce #1 over group 'world' "
                       "failed"))
      << run.output;
  EXPECT_TRUE(contains(run.output, "world rank 1 did not report the same failure")) << run.output;
  EXPECT_TRUE(contains(run.output,
                       "; the store did not answer within 3 s: the process that hosts "
                       "the store (hp-run, torchrun's agent, or else rank 0) is "
                       "stopped, or this machine is cut off from it"))
      << run.output;
  expect_no_backtrace(run.output);
  for (const auto& [rank, bound] : {std::pair{0, 0.5 + 2.0 + 3.0}, std::pair{1, 1.0 + 2.0 + 3.0}}) {
    std::smatch after_join;
    const std::regex line("\\[rank " + std::to_string(rank) +
                          "\\] world_join: failed after [0-9.]+ "
                          "s, ([0-9.]+) s after joining");
    ASSERT_TRUE(std::regex_search(run.output, after_join, line)) << run.output;
    EXPECT_LT(std::stod(after_join[1]), bound + 0.5) << "rank " << rank << "\n" << run.output;
  }
}

// HP_REQUIRE_GPU=1 where a rank has no GPU (these tests see none: CUDA_VISIBLE_DEVICES is
// empty for them): start-up fails on every rank, naming the rank and what it saw, instead
// of the job running on the CPU.
TEST(Startup, ARequiredGpuThatIsMissingIsNamedOnEveryRank) {
  const int port = find_free_port();
  const std::string require = "HP_REQUIRE_GPU=1 CUDA_VISIBLE_DEVICES= ";
  const Timed rank0 =
      timed(both("env " + require + rank_command(1, 2, port, 5) + " > /dev/null 2>&1",
                 "env " + require + rank_command(0, 2, port, 5)));
  EXPECT_EQ(rank0.run.exit_code, 1) << rank0.run.output;
  EXPECT_TRUE(contains(rank0.run.output,
                       "world_join: error: a GPU was required (WorldOptions::require_gpu or "
                       "HP_REQUIRE_GPU=1) but the job cannot run on GPUs: rank 0 has no GPU of "
                       "its own (LOCAL_RANK 0, 0 CUDA device(s) visible, CUDA_VISIBLE_DEVICES ''"))
      << rank0.run.output;
  expect_no_backtrace(rank0.run.output);
  EXPECT_LT(rank0.seconds, 4.9) << "at start-up, not after the timeout (5 s)";
}

}  // namespace
}  // namespace hp::testing
