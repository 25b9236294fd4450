// Tests for hp::launch_local and the hp-run program, with /bin/sh scripts as the ranks.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "error_of.h"
#include "launcher/launcher.h"
#include "loopback_listener.h"
#include "program_run.h"

#ifndef HP_RUN_PATH
#error "HP_RUN_PATH must name the hp-run executable"
#endif

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Script lines that record the rank shell's pid and start a background child whose pid is
// recorded too; ready.K then tells that both pid files of rank K are complete.
std::string record_pids() {
  return "echo $$ > \"$HP_TEST_DIR/rank.$RANK\"\n"
         "sleep 100 & echo $! > \"$HP_TEST_DIR/child.$RANK\"\n"
         ": > \"$HP_TEST_DIR/ready.$RANK\"\n";
}

// Script lines that make rank `rank` exit with `code` once all `nprocs` ranks have recorded
// their pids, so that the teardown has every pid on record.
std::string fail_when_all_ready(int rank, int nprocs, int code) {
  return "if [ \"$RANK\" = " + std::to_string(rank) + " ]; then\n" +
         "  while [ $(ls \"$HP_TEST_DIR\" | grep -c '^ready') -lt " + std::to_string(nprocs) +
         " ]; do sleep 0.02; done\n" + "  exit " + std::to_string(code) + "\nfi\n";
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "hp_launcher_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

hp::LaunchOptions sh_ranks(int nprocs, const std::string& script) {
  hp::LaunchOptions options;
  options.nprocs = nprocs;
  options.command = {"sh", "-c", script};
  options.prefix_output = false;
  options.timeout = 20s;  // backstop; the tests assert far shorter times
  return options;
}

// Pids recorded by record_pids() for every rank: the shells and their background children.
std::vector<pid_t> recorded_pids(const TempDir& dir, int nprocs) {
  std::vector<pid_t> pids;
  for (int r = 0; r < nprocs; ++r) {
    for (const char* kind : {"rank.", "child."}) {
      std::ifstream in(dir.path() + "/" + kind + std::to_string(r));
      pid_t pid = 0;
      if (in >> pid) pids.push_back(pid);
    }
  }
  return pids;
}

// True once `pid` no longer runs. A killed grandchild may linger as a zombie until init
// reaps it, so zombies count as gone, and there is a short wait for the reaping.
bool process_gone(pid_t pid) {
  const auto deadline = Clock::now() + 2s;
  while (true) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (std::getline(stat, line)) {
      const size_t paren = line.rfind(')');
      if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z') {
        return true;
      }
    }
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
}

void expect_no_survivors(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    EXPECT_TRUE(process_gone(pid)) << "process " << pid << " survived the launch";
  }
}

bool wait_for_ready_files(const TempDir& dir, int n) {
  // hp-run of a CUDA build loads LibTorch's CUDA libraries before it starts the ranks:
  // seconds on a busy machine.
  const auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline) {
    int ready = 0;
    for (const auto& entry : fs::directory_iterator(dir.path())) {
      ready += entry.path().filename().string().starts_with("ready.");
    }
    if (ready == n) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

using hp::testing::ProgramRun;

// Runs hp-run with `args` (a shell fragment) through /bin/sh.
ProgramRun run_hp_run(const std::string& args) {
  return hp::testing::run_program(std::string("'") + HP_RUN_PATH + "' " + args);
}

std::string what_of(const hp::LaunchOptions& options) {
  return hp::testing::error_of<c10::Error>([&] { hp::launch_local(options); });
}

TEST(Launcher, EveryRankGetsTorchrunEnvironment) {
  auto options =
      sh_ranks(3,
               "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $ROLE_RANK "
               "$ROLE_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $HP_EXTRA\"; echo err$RANK >&2");
  options.extra_env = {{"HP_EXTRA", "extra"}};
  const hp::LaunchResult result = hp::launch_local(options);

  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.first_failed_rank, -1);
  EXPECT_FALSE(result.timed_out);
  ASSERT_EQ(result.ranks.size(), 3u);
  int port = -1;
  for (int r = 0; r < 3; ++r) {
    const hp::RankResult& rank = result.ranks[r];
    EXPECT_EQ(rank.rank, r);
    EXPECT_EQ(rank.exit_code, 0);
    EXPECT_FALSE(rank.killed_by_launcher);
    std::istringstream lines(rank.output);
    std::string env_line, err_line;
    std::getline(lines, env_line);
    std::getline(lines, err_line);
    const std::string k = std::to_string(r);
    std::istringstream fields(env_line);
    std::string rank_, local, world, local_world, group, role, role_world, addr, extra;
    int rank_port = -1;
    fields >> rank_ >> local >> world >> local_world >> group >> role >> role_world >> addr >>
        rank_port >> extra;
    EXPECT_EQ(rank_ + local + role, k + k + k) << env_line;
    EXPECT_EQ(world + local_world + role_world, "333") << env_line;
    EXPECT_EQ(group, "0") << env_line;
    EXPECT_EQ(addr, "127.0.0.1") << env_line;
    EXPECT_EQ(extra, "extra") << env_line;
    EXPECT_GT(rank_port, 0) << env_line;
    EXPECT_LT(rank_port, 65536) << env_line;
    if (port < 0) port = rank_port;
    EXPECT_EQ(rank_port, port) << "ranks disagree on MASTER_PORT";
    EXPECT_EQ(err_line, "err" + k) << "stderr is not captured";
  }
}

TEST(Launcher, ExplicitMasterAddressAndPort) {
  auto options = sh_ranks(2, "echo \"$MASTER_ADDR:$MASTER_PORT\"");
  options.master_addr = "localhost";
  options.master_port = 29512;
  const hp::LaunchResult result = hp::launch_local(options);
  ASSERT_EQ(result.exit_code, 0);
  for (const hp::RankResult& rank : result.ranks) EXPECT_EQ(rank.output, "localhost:29512\n");
}

TEST(Launcher, PrefixModePrefixesEveryLine) {
  auto options = sh_ranks(2, "echo \"first $RANK\"; echo \"second $RANK\" >&2; printf last");
  options.prefix_output = true;
  testing::internal::CaptureStdout();
  const hp::LaunchResult result = hp::launch_local(options);
  const std::string out = testing::internal::GetCapturedStdout();

  EXPECT_EQ(result.exit_code, 0);
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  for (const std::string r : {"0", "1"}) {
    EXPECT_TRUE(result.ranks[std::stoi(r)].output.empty());
    // Per rank, lines keep their order; ranks may interleave.
    std::vector<std::string> own;
    for (const std::string& line : lines) {
      if (line.starts_with("[rank " + r + "] ")) own.push_back(line);
    }
    const std::vector<std::string> expected = {
        "[rank " + r + "] first " + r, "[rank " + r + "] second " + r, "[rank " + r + "] last"};
    EXPECT_EQ(own, expected) << out;
  }
  EXPECT_EQ(lines.size(), 6u) << out;
  EXPECT_TRUE(out.ends_with("\n")) << out;
}

TEST(Launcher, FailingRankTearsDownTheOthers) {
  TempDir dir;
  auto options = sh_ranks(3, record_pids() + fail_when_all_ready(1, 3, 3) + "wait\n");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  const auto start = Clock::now();
  const hp::LaunchResult result = hp::launch_local(options);
  const double elapsed = seconds_since(start);

  EXPECT_LT(elapsed, 10);
  EXPECT_EQ(result.exit_code, 3);
  EXPECT_EQ(result.first_failed_rank, 1);
  EXPECT_FALSE(result.timed_out);
  EXPECT_EQ(result.ranks[1].exit_code, 3);
  EXPECT_FALSE(result.ranks[1].killed_by_launcher);
  for (int r : {0, 2}) {
    EXPECT_TRUE(result.ranks[r].killed_by_launcher) << "rank " << r;
    EXPECT_EQ(result.ranks[r].exit_code, 128 + SIGTERM) << "rank " << r;
  }
  const std::vector<pid_t> pids = recorded_pids(dir, 3);
  EXPECT_EQ(pids.size(), 6u);
  expect_no_survivors(pids);
}

TEST(Launcher, TerminationReachesTheRanksChildren) {
  TempDir dir;
  // Rank 1 survives SIGTERM itself and then waits for its child, which only the signal to
  // the whole process group stops before the SIGKILL that follows the grace period.
  auto options = sh_ranks(2, "trap 'echo caught' TERM\n" + record_pids() +
                                 fail_when_all_ready(0, 2, 1) + "wait; wait; echo child done\n");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  const hp::LaunchResult result = hp::launch_local(options);

  EXPECT_EQ(result.first_failed_rank, 0);
  EXPECT_TRUE(result.ranks[1].killed_by_launcher);
  EXPECT_EQ(result.ranks[1].exit_code, 0);
  EXPECT_EQ(result.ranks[1].output, "caught\nchild done\n");
  expect_no_survivors(recorded_pids(dir, 2));
}

TEST(Launcher, RankIgnoringSigtermIsKilledAfterGracePeriod) {
  TempDir dir;
  auto options =
      sh_ranks(2, "trap '' TERM\n" + record_pids() + fail_when_all_ready(0, 2, 1) + "wait\n");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  const auto start = Clock::now();
  const hp::LaunchResult result = hp::launch_local(options);
  const double elapsed = seconds_since(start);

  EXPECT_GE(elapsed, 2) << "SIGKILL came before the grace period";
  EXPECT_LT(elapsed, 10);
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.first_failed_rank, 0);
  EXPECT_TRUE(result.ranks[1].killed_by_launcher);
  EXPECT_EQ(result.ranks[1].exit_code, 128 + SIGKILL);
  expect_no_survivors(recorded_pids(dir, 2));
}

TEST(Launcher, TimeoutKillsHangingRanks) {
  TempDir dir;
  auto options = sh_ranks(2, record_pids() + "wait\n");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  options.timeout = 1s;
  const auto start = Clock::now();
  const hp::LaunchResult result = hp::launch_local(options);
  const double elapsed = seconds_since(start);

  EXPECT_GE(elapsed, 1);
  EXPECT_LT(elapsed, 10);
  EXPECT_TRUE(result.timed_out);
  EXPECT_EQ(result.exit_code, 124);
  EXPECT_EQ(result.first_failed_rank, -1);
  for (const hp::RankResult& rank : result.ranks) {
    EXPECT_TRUE(rank.killed_by_launcher) << "rank " << rank.rank;
    EXPECT_NE(rank.exit_code, 0) << "rank " << rank.rank;
  }
  const std::vector<pid_t> pids = recorded_pids(dir, 2);
  EXPECT_EQ(pids.size(), 4u);
  expect_no_survivors(pids);
}

TEST(Launcher, GrandchildHoldingThePipeDoesNotBlockTheLaunch) {
  TempDir dir;
  // The background sleep inherits the rank's stdout and outlives the rank.
  auto options = sh_ranks(1, "sleep 100 & echo $! > \"$HP_TEST_DIR/child.0\"; echo done");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  const auto start = Clock::now();
  const hp::LaunchResult result = hp::launch_local(options);
  const double elapsed = seconds_since(start);
  for (pid_t pid : recorded_pids(dir, 1)) kill(pid, SIGKILL);

  EXPECT_LT(elapsed, 5);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.ranks[0].output, "done\n");
}

int g_test_handler_signal = 0;
void test_handler(int sig) { g_test_handler_signal = sig; }

TEST(Launcher, InterruptIsForwardedToRanksAndReRaised) {
  TempDir dir;
  auto options = sh_ranks(2, record_pids() + "wait\n");
  options.extra_env = {{"HP_TEST_DIR", dir.path()}};
  struct sigaction ours{};
  struct sigaction previous{};
  ours.sa_handler = test_handler;
  sigemptyset(&ours.sa_mask);
  ASSERT_EQ(sigaction(SIGTERM, &ours, &previous), 0);
  g_test_handler_signal = 0;

  std::thread interrupter([&] {
    if (wait_for_ready_files(dir, 2)) kill(getpid(), SIGTERM);
  });
  const auto start = Clock::now();
  const hp::LaunchResult result = hp::launch_local(options);
  const double elapsed = seconds_since(start);
  interrupter.join();
  sigaction(SIGTERM, &previous, nullptr);

  EXPECT_LT(elapsed, 10);
  EXPECT_EQ(result.exit_code, 128 + SIGTERM);
  EXPECT_EQ(result.interrupted_by, SIGTERM);  // hp-run restarts nothing after it
  EXPECT_EQ(g_test_handler_signal, SIGTERM) << "the signal was not re-raised to our handler";
  for (const hp::RankResult& rank : result.ranks) {
    EXPECT_TRUE(rank.killed_by_launcher) << "rank " << rank.rank;
  }
  expect_no_survivors(recorded_pids(dir, 2));
}

TEST(Launcher, RejectsBadOptions) {
  hp::LaunchOptions options;
  options.command = {"true"};
  options.nprocs = 0;
  EXPECT_NE(what_of(options).find("nprocs"), std::string::npos);
  options.nprocs = 1;
  options.command.clear();
  EXPECT_NE(what_of(options).find("command is empty"), std::string::npos);
}

TEST(Launcher, ReportsProgramsThatCannotBeExecuted) {
  hp::LaunchOptions options;
  options.nprocs = 2;
  options.command = {"/nonexistent/hp-program"};
  std::string what = what_of(options);
  EXPECT_NE(what.find("cannot execute '/nonexistent/hp-program'"), std::string::npos) << what;
  EXPECT_NE(what.find("No such file"), std::string::npos) << what;

  options.command = {"hp-no-such-program-on-path"};
  what = what_of(options);
  EXPECT_NE(what.find("cannot execute 'hp-no-such-program-on-path'"), std::string::npos) << what;
}

// The launcher hosts the store on the port it chose for the whole launch (nothing else can
// take the port, and a rank that exits takes no store with it) and tells every rank so, as
// torchrun's agent does; a variable of an outer launcher's own store protocol is not passed on.
TEST(Launcher, HostsTheStoreOnTheChosenPortAndTellsTheRanks) {
  auto options = sh_ranks(2,
                          "echo \"$TORCHELASTIC_USE_AGENT_STORE $TORCHELASTIC_RESTART_COUNT\"; "
                          "python3 -c 'import os, socket; socket.socket().bind((\"127.0.0.1\", "
                          "int(os.environ[\"MASTER_PORT\"])))' 2>&1 | tail -n 1");
  const hp::LaunchResult result = hp::launch_local(options);
  ASSERT_EQ(result.exit_code, 0) << result.ranks[0].output << result.ranks[1].output;
  for (const hp::RankResult& rank : result.ranks) {
    EXPECT_EQ(rank.output, "True 0\nOSError: [Errno 98] Address already in use\n") << rank.rank;
  }
  // A restart count given by the caller (hp-run --max-restarts) is kept.
  options.extra_env = {{"TORCHELASTIC_RESTART_COUNT", "3"}};
  options.command = {"sh", "-c", "echo $TORCHELASTIC_RESTART_COUNT"};
  EXPECT_EQ(hp::launch_local(options).ranks[1].output, "3\n");
}

// The store has no authentication: it listens on --master-addr alone, with a port given
// (TCPStore's own listener took every interface, IPv4 and IPv6) as with one chosen here.
TEST(Launcher, TheStoreListensOnTheMasterAddressOnly) {
  const std::string probe =
      "python3 -c 'import os, socket\n"
      "for host in (\"127.0.0.1\", \"127.0.0.2\", \"::1\"):\n"
      "  s = socket.socket(socket.AF_INET6 if \":\" in host else socket.AF_INET)\n"
      "  print(host, \"refused\" if s.connect_ex((host, int(os.environ[\"MASTER_PORT\"]))) "
      "else \"open\")'";
  for (const int port : {hp::find_free_port("127.0.0.1"), 0}) {
    SCOPED_TRACE(port);
    auto options = sh_ranks(1, probe);
    options.master_port = port;
    const hp::LaunchResult result = hp::launch_local(options);
    ASSERT_EQ(result.exit_code, 0) << result.ranks[0].output;
    EXPECT_EQ(result.ranks[0].output, "127.0.0.1 open\n127.0.0.2 refused\n::1 refused\n");
  }
}

TEST(Launcher, AnExplicitPortInUseIsNamed) {
  const hp::testing::LoopbackListener listener;
  auto options = sh_ranks(2, "true");
  options.master_port = listener.port();
  const std::string what = what_of(options);
  EXPECT_NE(what.find("cannot host the store on 127.0.0.1:" + std::to_string(listener.port())),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("pick a free --master-port"), std::string::npos) << what;
}

TEST(Launcher, FindFreePortReturnsABindablePort) {
  const int port = hp::find_free_port("127.0.0.1");
  ASSERT_GT(port, 0);
  ASSERT_LT(port, 65536);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  close(fd);
  // A documentation-only address (RFC 5737) that no local interface has: bind must fail.
  EXPECT_THROW(hp::find_free_port("192.0.2.1"), c10::Error);
}

TEST(HpRun, ExitsWithTheFailingRanksCode) {
  const ProgramRun run = run_hp_run("-n 2 -- sh -c 'exit $RANK'");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("hp-run: rank 1 exited with code 1"), std::string::npos) << run.output;
  // A code no failure path of hp-run uses itself: the rank's, passed through.
  const ProgramRun seven = run_hp_run("-n 2 -- sh -c '[ $RANK = 1 ] && exit 7; sleep 30'");
  EXPECT_EQ(seven.exit_code, 7) << seven.output;
  EXPECT_NE(seven.output.find("hp-run: rank 1 exited with code 7"), std::string::npos)
      << seven.output;
}

TEST(HpRun, PrefixesOutputAndSucceeds) {
  const ProgramRun run = run_hp_run("--nproc-per-node 2 sh -c 'echo \"hi $RANK\"'");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("[rank 0] hi 0\n"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("[rank 1] hi 1\n"), std::string::npos) << run.output;
}

// Any torchrun-style program runs under hp-run: PyTorch's own init_process_group connects
// to the store hp-run hosts (it would fail to host one on MASTER_PORT itself).
TEST(HpRun, RunsAPythonTorchProgram) {
  const ProgramRun run = run_hp_run("-n 2 --timeout 120 -- python3 " + std::string(HP_SOURCE_DIR) +
                                    "/tests/python/torch_allreduce.py");
  if (run.exit_code == 77) GTEST_SKIP() << "python3 cannot import torch.distributed";
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("[rank 0] rank 0 of 2: sum 3, expected 3"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("[rank 1] rank 1 of 2: sum 3, expected 3"), std::string::npos)
      << run.output;
}

TEST(HpRun, TimeoutExitsWith124) {
  const auto start = Clock::now();
  const ProgramRun run = run_hp_run("-n 2 --timeout 0.5 -- sleep 100");
  EXPECT_LT(seconds_since(start), 10);
  EXPECT_EQ(run.exit_code, 124) << run.output;
  EXPECT_NE(run.output.find("hp-run: timeout after 0.5 s; killed all ranks"), std::string::npos)
      << run.output;
}

// Rank 1 fails in the first two attempts (rank 0 waits and is stopped); every rank of the
// third succeeds. Each attempt sees its number as under torchrun.
TEST(HpRun, MaxRestartsStartsAllRanksAgain) {
  const std::string script =
      "-- sh -c 'echo \"attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS\"; "
      "if [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then [ $RANK = 1 ] && exit 3; sleep 30; fi; "
      "echo \"done $RANK\"'";
  const ProgramRun restarted = run_hp_run("-n 2 --max-restarts 2 " + script);
  EXPECT_EQ(restarted.exit_code, 0) << restarted.output;
  for (const char* line :
       {"[rank 1] attempt 0 of 2", "hp-run: rank 1 exited with code 3",
        "hp-run: restarting all 2 ranks (restart 1 of 2)", "[rank 1] attempt 1 of 2",
        "(restart 2 of 2)", "[rank 0] attempt 2 of 2", "[rank 0] done 0", "[rank 1] done 1"}) {
    EXPECT_NE(restarted.output.find(line), std::string::npos) << line << "\n" << restarted.output;
  }
  const ProgramRun gave_up = run_hp_run("-n 2 --max-restarts 1 " + script);
  EXPECT_EQ(gave_up.exit_code, 3) << gave_up.output;
  EXPECT_NE(gave_up.output.find("(restart 1 of 1)"), std::string::npos) << gave_up.output;
  EXPECT_EQ(gave_up.output.find("done"), std::string::npos) << gave_up.output;
}

TEST(HpRun, BadFlagsGiveUsageErrors) {
  for (const char* args :
       {"--bogus -- true", "-n 0 -- true", "-n two -- true", "-n 2", "--max-restarts -1 -- true",
        "--timeout -1 -- true", "--master-port 70000 -- true", "-n", "--grace-period -1 -- true",
        "--grace-period nan -- true"}) {
    const ProgramRun run = run_hp_run(args);
    EXPECT_EQ(run.exit_code, 2) << args << "\n" << run.output;
    EXPECT_NE(run.output.find("usage: hp-run"), std::string::npos) << args << "\n" << run.output;
  }
  const ProgramRun help = run_hp_run("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--nproc-per-node"), std::string::npos) << help.output;
}

TEST(HpRun, MissingProgramIsReported) {
  const ProgramRun run = run_hp_run("-n 2 -- /nonexistent/hp-program");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("cannot execute"), std::string::npos) << run.output;
}

// hp-run started with fork + exec, its output (and its ranks') in DIR/output, HP_TEST_DIR
// set for the ranks' scripts.
class HpRunProcess {
 public:
  HpRunProcess(const TempDir& dir, std::vector<std::string> args)
      : output_(dir.path() + "/output") {
    args.insert(args.begin(), HP_RUN_PATH);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    setenv("HP_TEST_DIR", dir.path().c_str(), 1);  // inherited by hp-run and its ranks
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(output_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      execv(HP_RUN_PATH, argv.data());
      _exit(127);
    }
    unsetenv("HP_TEST_DIR");
  }
  ~HpRunProcess() {
    if (pid_ > 0 && !status_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }

  // Its wait status once it has exited, or unset when it still runs after `limit` (then it
  // is killed).
  std::optional<int> wait(std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(20ms);
    }
    status_ = status;
    return status_;
  }

  std::string output() const {
    std::ifstream in(output_);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

 private:
  std::string output_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

bool died_of(std::optional<int> status, int sig) {
  return status && WIFSIGNALED(*status) && WTERMSIG(*status) == sig;
}

TEST(HpRun, SigtermIsForwardedToRanks) {
  TempDir dir;
  HpRunProcess hp_run(dir, {"-n", "2", "--", "sh", "-c", record_pids() + "wait\n"});
  ASSERT_GT(hp_run.pid(), 0);
  ASSERT_TRUE(wait_for_ready_files(dir, 2)) << "the ranks never started";
  kill(hp_run.pid(), SIGTERM);
  const std::optional<int> status = hp_run.wait(10s);
  ASSERT_TRUE(status) << "hp-run did not stop after SIGTERM";
  EXPECT_TRUE(died_of(status, SIGTERM))
      << "hp-run should die from the re-raised SIGTERM, status " << *status;
  expect_no_survivors(recorded_pids(dir, 2));
}

// After a signal the ranks get --grace-period to exit (longer than the 2 s after a
// failure): a rank that takes 3 s to "save" finishes. A rank still running when the grace
// period ends is SIGKILLed, and so is every rank at a second signal.
TEST(HpRun, RanksGetTheGracePeriodAfterASignalAndASecondOneKillsThemAtOnce) {
  const auto saving_ranks = [](const std::string& seconds) {
    return std::vector<std::string>{"--", "sh", "-c",
                                    "trap 'sleep " + seconds +
                                        "; : > \"$HP_TEST_DIR/saved.$RANK\"; exit 143' TERM INT\n" +
                                        record_pids() + "wait\n"};
  };
  const auto with = [](std::vector<std::string> flags, const std::vector<std::string>& ranks) {
    flags.insert(flags.end(), ranks.begin(), ranks.end());
    return flags;
  };
  {
    TempDir dir;
    HpRunProcess hp_run(dir, with({"-n", "2", "--grace-period", "20"}, saving_ranks("3")));
    ASSERT_TRUE(wait_for_ready_files(dir, 2)) << "the ranks never started";
    const auto start = Clock::now();
    kill(hp_run.pid(), SIGTERM);
    const std::optional<int> status = hp_run.wait(30s);
    EXPECT_GE(seconds_since(start), 3);
    EXPECT_TRUE(died_of(status, SIGTERM)) << hp_run.output();
    for (const char* saved : {"/saved.0", "/saved.1"}) {
      EXPECT_TRUE(fs::exists(dir.path() + saved)) << saved << "\n" << hp_run.output();
    }
    EXPECT_NE(hp_run.output().find("[launcher] SIGTERM passed on to the ranks, which have 20 s "
                                   "to exit before SIGKILL (another signal: at once)"),
              std::string::npos)
        << hp_run.output();
  }
  for (const bool second_signal : {false, true}) {
    SCOPED_TRACE(second_signal ? "a second signal" : "the grace period runs out");
    TempDir dir;
    HpRunProcess hp_run(
        dir, with({"-n", "2", "--grace-period", second_signal ? "20" : "1"}, saving_ranks("30")));
    ASSERT_TRUE(wait_for_ready_files(dir, 2)) << "the ranks never started";
    const auto start = Clock::now();
    kill(hp_run.pid(), SIGINT);
    if (second_signal) {
      std::this_thread::sleep_for(500ms);
      kill(hp_run.pid(), SIGTERM);
    }
    const std::optional<int> status = hp_run.wait(10s);
    const double elapsed = seconds_since(start);
    ASSERT_TRUE(status) << hp_run.output();
    EXPECT_TRUE(died_of(status, SIGINT)) << "status " << *status << "\n" << hp_run.output();
    EXPECT_GE(elapsed, second_signal ? 0.5 : 1);
    EXPECT_LT(elapsed, 5);
    EXPECT_NE(
        hp_run.output().find(second_signal ? "[launcher] another SIGTERM: killed rank(s) 0, 1"
                                           : "[launcher] the grace period of 1 s ran out: killed "
                                             "rank(s) 0, 1"),
        std::string::npos)
        << hp_run.output();
    EXPECT_FALSE(fs::exists(dir.path() + "/saved.0"));
    expect_no_survivors(recorded_pids(dir, 2));
  }
}

}  // namespace
