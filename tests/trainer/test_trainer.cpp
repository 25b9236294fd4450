// The trainer (trainer/train_decoder) as a user runs it, on a frozen copy of this
// repository's docs (tests/data/corpus): a
// short run learns below the unigram baseline and writes a metrics file and a loss curve
// that agree with what it printed; under hp-run's restarts, a run whose ranks are killed
// at random steps resumes from its newest sharded checkpoint (--resume auto) and ends with the
// checkpoint files of an uninterrupted run, byte for byte, and so does a run preempted by
// SIGTERM (a last-words checkpoint at the step it stopped); a save directory that cannot
// be written and a missing corpus fail before the first step; flags override a config
// file; a rank that never starts is named within --timeout; the real torchrun launches it
// (its agent hosting the store) and restarts it; tensor, context and expert parallelism
// on 8 ranks train like data parallelism alone; pipeline parallelism (--pp) learns, its
// schedules give the same losses bit for bit, its checkpoints restart bitwise and resume
// without --pp (and back), with expert parallelism it trains like without, and what it
// cannot do is a usage error.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "hyperparallel/sharded_checkpoint.h"
#include "hyperparallel/state_dict.h"
#include "launcher/launcher.h"
#include "program_run.h"

#ifndef HP_RUN_PATH
#error "HP_RUN_PATH must name the hp-run executable"
#endif
#ifndef TRAIN_DECODER_PATH
#error "TRAIN_DECODER_PATH must name the train_decoder executable"
#endif
#ifndef HP_SOURCE_DIR
#error "HP_SOURCE_DIR must name the source directory"
#endif

namespace hp::testing {
namespace {

namespace fs = std::filesystem;

// The text every run trains on, as --data flags: a frozen copy of the docs, so that editing
// the docs moves no test's losses (tests/data/README.md).
std::string corpus_flags() {
  const std::string corpus = std::string(HP_SOURCE_DIR) + "/tests/data/corpus";
  return " --data " + corpus + "/docs --data " + corpus + "/README.md ";
}

// hp-run training a small model on `ranks` ranks (mesh `mesh`).
std::string train_command(int ranks, const std::string& mesh, const std::string& hp_run_flags,
                          const std::string& trainer_flags) {
  return std::string(HP_RUN_PATH) + " -n " + std::to_string(ranks) + " --timeout 120 " +
         hp_run_flags + " -- " + TRAIN_DECODER_PATH + corpus_flags() + "--mesh " + mesh +
         " --batch 16 --lr 1e-2 --warmup 10 --eval-batches 4 --sample-bytes 40 " + trainer_flags;
}

// A small model on 2 ranks.
ProgramRun train(const std::string& hp_run_flags, const std::string& trainer_flags) {
  return run_program(train_command(2, "1x2", hp_run_flags, trainer_flags));
}

std::string contents(const fs::path& file) {
  std::ifstream stream(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("hp_trainer_" + std::to_string(getpid()));
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
};

// The run's closing verdict line ("OK: validation loss ..."), or "".
std::string verdict(const std::string& output) {
  const size_t start = output.rfind("validation loss ");
  return start == std::string::npos ? "" : output.substr(start, output.find('\n', start) - start);
}

// The checkpoints of `step` under the save directories `expected` and `actual`, written by
// `ranks` ranks, are the same byte for byte.
void expect_same_checkpoint(const std::string& expected, const std::string& actual, int64_t step,
                            int ranks) {
  std::vector<std::string> files = {"index.json", "COMPLETE"};
  for (int r = 0; r < ranks; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.safetensors", r);
    files.emplace_back(name);
  }
  for (const std::string& file : files) {
    const fs::path want = fs::path(checkpoint_dir_for_step(expected, step)) / file;
    ASSERT_TRUE(fs::exists(want)) << want;
    EXPECT_TRUE(contents(fs::path(checkpoint_dir_for_step(actual, step)) / file) == contents(want))
        << file << " differs from the uninterrupted run's";
  }
}

TEST(Trainer, LearnsBelowTheUnigramBaselineAndWritesMetricsAndCurve) {
  TempDir dir;
  const std::string out = (dir.path / "out").string();
  const ProgramRun run = train("", "--steps 120 --require-learning --out " + out);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::smatch verdict = [&] {
    std::smatch match;
    std::regex_search(run.output, match,
                      std::regex("OK: validation loss ([0-9.]+) \\(perplexity [0-9.]+\\) below "
                                 "the unigram baseline ([0-9.]+)"));
    return match;
  }();
  ASSERT_FALSE(verdict.empty()) << run.output;
  EXPECT_LT(std::stod(verdict[1]), std::stod(verdict[2]));
  // The closing report: a sample after the prompt, every rank's peak memory, the model
  // FLOPs utilisation against the measured matmul rate.
  std::smatch sample;
  ASSERT_TRUE(
      std::regex_search(run.output, sample,
                        std::regex("\\[rank 0\\] sample:\n\\[rank 0\\] fully_shard\\(([\\s\\S]*?)"
                                   "\n\\[rank 0\\] \n\\[rank 0\\] peak RSS")))
      << run.output;
  // The 40 sampled bytes, newlines too (the launcher prefixes each line with the rank).
  std::string sampled = sample[1];
  for (size_t at = 0; (at = sampled.find("\n[rank 0] ", at)) != std::string::npos; ++at) {
    sampled.erase(at + 1, 9);
  }
  EXPECT_EQ(sampled.size(), 40u) << sampled;
  EXPECT_TRUE(std::regex_search(run.output, std::regex("peak RSS per rank \\(MiB\\): [1-9][0-9]* "
                                                       "[1-9][0-9]*\n")))
      << run.output;
  EXPECT_TRUE(std::regex_search(
      run.output, std::regex("model FLOPs utilisation [0-9.]+% \\([0-9.]+ GFLOP/s of 2 "
                             "ranks x [0-9.]+ GFLOP/s measured fp32 matmul\\)")))
      << run.output;

  // One record per logged step, steps increasing; the validation losses are the printed ones.
  std::vector<std::string> printed;
  const std::regex validation_line("validation loss ([0-9.]+)  perplexity");
  for (auto it = std::sregex_iterator(run.output.begin(), run.output.end(), validation_line);
       it != std::sregex_iterator(); ++it) {
    printed.push_back((*it)[1]);
  }
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  int64_t last_step = 0, records = 0;
  std::vector<std::string> logged;
  while (std::getline(metrics, line)) {
    const nlohmann::json record = nlohmann::json::parse(line);
    EXPECT_GT(record.at("step").get<int64_t>(), last_step) << line;
    EXPECT_FALSE(record.contains("balance_loss")) << "a dense model has none: " << line;
    last_step = record["step"].get<int64_t>();
    ++records;
    if (record.contains("validation_loss")) {
      char text[32];
      std::snprintf(text, sizeof text, "%.4f", record["validation_loss"].get<double>());
      logged.push_back(text);
      EXPECT_NEAR(record["validation_perplexity"].get<double>(),
                  std::exp(record["validation_loss"].get<double>()), 1e-9);
    }
  }
  EXPECT_EQ(last_step, 120);
  EXPECT_GE(records, 20);
  EXPECT_EQ(logged, printed);
  EXPECT_EQ(printed.size(), 5u);

  // Well-formed XML with one path per curve (Python's XML parser).
  const ProgramRun svg = run_program(
      "python3 -c \"import sys, xml.etree.ElementTree as E; "
      "paths = E.parse(sys.argv[1]).getroot().iter('{http://www.w3.org/2000/svg}path'); "
      "print('curves', sorted(p.get('class') for p in paths))\" " +
      out + "/loss.svg");
  EXPECT_EQ(svg.exit_code, 0) << svg.output;
  EXPECT_TRUE(contains(svg.output, "curves ['train', 'validation']")) << svg.output;
}

TEST(Trainer, RestartedRunEndsBitwiseEqualToUninterrupted) {
  TempDir dir;
  const std::string straight = (dir.path / "straight").string();
  const std::string restarted = (dir.path / "restarted").string();
  const int64_t steps = 60, save_every = 20;
  const std::string flags = "--steps 60 --save-every 20 --resume auto --save ";

  const ProgramRun reference = train("", flags + straight);
  ASSERT_TRUE(contains(reference.output, "no complete checkpoint under " + straight))
      << reference.output;

  // Two faults at random: a random rank is SIGKILLed before a random step, once in the
  // first attempt and once in the second (after the step that attempt resumed from).
  std::mt19937 random(std::random_device{}());
  const auto pick = [&](int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high)(random);
  };
  const int64_t first_step = pick(2, steps);
  const int64_t first_resume = (first_step - 1) / save_every * save_every;
  const int64_t second_step = pick(first_resume + 1, steps);
  const int64_t second_resume = (second_step - 1) / save_every * save_every;
  const int64_t first_rank = pick(0, 1), second_rank = pick(0, 1);
  SCOPED_TRACE("rank " + std::to_string(first_rank) + " killed before step " +
               std::to_string(first_step) + ", then rank " + std::to_string(second_rank) +
               " before step " + std::to_string(second_step));
  const ProgramRun run =
      train("--max-restarts 2", flags + restarted + " --fail-by-kill --fail-at-step " +
                                    std::to_string(first_step) + " " + std::to_string(second_step) +
                                    " --fail-rank " + std::to_string(first_rank) + " " +
                                    std::to_string(second_rank));
  EXPECT_EQ(run.exit_code, reference.exit_code) << run.output;
  std::vector<std::string> expected_lines = {
      "--fail-at-step " + std::to_string(first_step) + ": rank " + std::to_string(first_rank) +
          " fails on purpose",
      "--fail-at-step " + std::to_string(second_step) + ": rank " + std::to_string(second_rank) +
          " fails on purpose",
      "hp-run: restarting all 2 ranks (restart 1 of 2)",
      "hp-run: restarting all 2 ranks (restart 2 of 2)"};
  for (int64_t resume : {first_resume, second_resume}) {
    if (resume > 0) {
      expected_lines.push_back("resumed from " + checkpoint_dir_for_step(restarted, resume) +
                               " after " + std::to_string(resume) + " steps");
    }
  }
  for (const std::string& line : expected_lines) {
    EXPECT_TRUE(contains(run.output, line)) << line << "\n" << run.output;
  }
  ASSERT_NE(verdict(reference.output), "") << reference.output;
  EXPECT_EQ(verdict(run.output), verdict(reference.output));
  expect_same_checkpoint(straight, restarted, steps, 2);
}

// --async-save writes the same checkpoints, byte for byte, as the synchronous saves, while
// training goes on (the snapshot is the state after the step, not a later one).
TEST(Trainer, AsyncSavesWriteTheSameCheckpointsAsSynchronousOnes) {
  TempDir dir;
  const std::string sync = (dir.path / "sync").string();
  const std::string async = (dir.path / "async").string();
  const std::string flags = "--steps 30 --save-every 10 --save ";
  const ProgramRun reference = train("", flags + sync);
  const ProgramRun run = train("", flags + async + " --async-save");
  ASSERT_EQ(run.exit_code, reference.exit_code) << run.output;
  EXPECT_TRUE(
      contains(run.output, "saving " + checkpoint_dir_for_step(async, 10) + " in the background"))
      << run.output;
  for (int64_t step : {10, 20, 30}) expect_same_checkpoint(sync, async, step, 2);
  const ProgramRun refused = train("", "--steps 2 --async-save --save " + async);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_TRUE(contains(refused.output, "--async-save writes the --save-every checkpoints"))
      << refused.output;
}

// A command started in the background through /bin/sh, which execs it (the pid is the
// command's), its output going to a file.
class BackgroundRun {
 public:
  BackgroundRun(const std::string& command_line, const fs::path& output) : output_(output) {
    const std::string line = "exec " + command_line + " > '" + output.string() + "' 2>&1";
    pid_ = fork();  // only exec in the child: the parent may have threads
    if (pid_ == 0) {
      execl("/bin/sh", "sh", "-c", line.c_str(), nullptr);
      _exit(127);
    }
  }
  ~BackgroundRun() {
    if (pid_ > 0 && !exit_code_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  BackgroundRun(const BackgroundRun&) = delete;
  BackgroundRun& operator=(const BackgroundRun&) = delete;

  pid_t pid() const { return pid_; }
  std::string output() const { return contents(output_); }

  // Its exit code (128 + N when signal N ended it) once it has exited; unset when it still
  // runs at the deadline.
  std::optional<int> wait(std::chrono::steady_clock::time_point deadline) {
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return exit_code_;
  }

 private:
  fs::path output_;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
};

// The highest step rank 0's progress lines show; 0 before the first.
int64_t last_logged_step(const std::string& output) {
  int64_t last = 0;
  const std::regex line("\\[rank 0\\] step +([0-9]+)/[0-9]+  loss");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    last = std::max<int64_t>(last, std::stoll((*it)[1]));
  }
  return last;
}

// The processes whose parent is `parent` (from /proc).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> children;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = contents(entry.path() / "stat");  // "pid (comm) state ppid ..."
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + paren + 1, " %c %d", &state, &ppid) == 2 && ppid == parent) {
      children.push_back(std::stoi(name));
    }
  }
  return children;
}

struct Preempted {
  std::optional<int> exit_code;  // hp-run's: 143 when it died of the SIGTERM it passed on
  std::string output;
  int64_t logged_at_signal = 0;  // the last step logged when the signal reached the ranks
  double seconds = 0;            // from then to hp-run's exit
};

// Runs hp-run `command` until rank 0 has logged step `after`, then preempts it: SIGTERM to
// hp-run, which passes it on to the ranks. The ranks are held (SIGSTOP) meanwhile, so that
// the step they are in is known however late the log lines reach the file on a busy
// machine: the one after the last logged.
Preempted preempt(const std::string& command, const fs::path& output, int64_t after) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  BackgroundRun run(command, output);
  Preempted preempted;
  const auto waited = [&](const std::string& what, const std::function<bool()>& done) {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (!done()) {
      if (run.wait(Clock::now()) || Clock::now() > deadline) {
        preempted.output = run.output();
        ADD_FAILURE() << "the run ended, or never " << what << "\n" << preempted.output;
        return false;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    return true;
  };
  if (!waited("logged step " + std::to_string(after),
              [&] { return last_logged_step(run.output()) >= after; })) {
    return preempted;
  }
  const std::vector<pid_t> ranks = children_of(run.pid());
  EXPECT_EQ(ranks.size(), 4u);
  for (pid_t rank : ranks) kill(-rank, SIGSTOP);   // each rank leads its process group
  std::this_thread::sleep_for(milliseconds(300));  // hp-run copies what they printed
  preempted.logged_at_signal = last_logged_step(run.output());
  kill(run.pid(), SIGTERM);
  const bool passed_on = waited("passed SIGTERM on", [&] {
    return contains(run.output(), "[launcher] SIGTERM passed on to the ranks");
  });
  for (pid_t rank : ranks) kill(-rank, SIGCONT);
  if (!passed_on) return preempted;
  const auto signalled = Clock::now();
  preempted.exit_code = run.wait(signalled + std::chrono::seconds(40));
  preempted.seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
  preempted.output = run.output();
  return preempted;
}

// Preemption: hp-run passes SIGTERM on to the 4 ranks, which finish the step in progress
// together (one all-reduce per step tells every rank), write a last-words checkpoint at it
// and exit; hp-run then dies of SIGTERM (143). A second preemption with a 50 ms trainer
// grace period ends the ranks at once wherever it finds them (in a step, in a save). Then
// --resume auto ends with the checkpoint files of an uninterrupted run, byte for byte.
TEST(Trainer, PreemptedRunSavesLastWordsAndResumesBitwiseEqual) {
  TempDir dir;
  fs::create_directories(dir.path);
  const std::string straight = (dir.path / "straight").string();
  const std::string preempted = (dir.path / "preempted").string();
  const int64_t steps = 40;
  const auto command = [&](const std::string& save, const std::string& extra) {
    return train_command(4, "2x2", "",
                         "--steps 40 --log-every 1 --resume auto --save " + save + " " + extra);
  };
  const ProgramRun reference = run_program(command(straight, ""));
  ASSERT_NE(verdict(reference.output), "") << reference.output;

  const Preempted first = preempt(command(preempted, ""), dir.path / "first.log", 10);
  RecordProperty("seconds_from_sigterm_to_exit", std::to_string(first.seconds));
  EXPECT_EQ(first.exit_code, 128 + SIGTERM) << first.output;
  EXPECT_LT(first.seconds, 20) << "slower than the trainer's grace period allows";
  std::smatch said;
  ASSERT_TRUE(std::regex_search(
      first.output, said,
      std::regex("\\[rank 0\\] preempted: last-words checkpoint at step ([0-9]+) in (\\S+)\n")))
      << first.output;
  // The step in progress when the signal came (the next one only if a rank had already
  // agreed on it and not yet logged it).
  const int64_t last_words = std::stoll(said[1]);
  RecordProperty("last_logged_step_at_sigterm", std::to_string(first.logged_at_signal));
  RecordProperty("last_words_step", std::to_string(last_words));
  EXPECT_GT(last_words, first.logged_at_signal) << first.output;
  EXPECT_LE(last_words, first.logged_at_signal + 2) << first.output;
  EXPECT_EQ(said[2], checkpoint_dir_for_step(preempted, last_words));
  EXPECT_TRUE(contains(first.output, "preempted by SIGTERM: stopped after step " +
                                         std::to_string(last_words) + "; exit status 143"))
      << first.output;
  EXPECT_EQ(last_logged_step(first.output), last_words) << first.output;
  // Complete, the only one, and marked.
  EXPECT_EQ(latest_checkpoint(preempted), checkpoint_dir_for_step(preempted, last_words));
  EXPECT_EQ(std::distance(fs::directory_iterator(preempted), fs::directory_iterator()), 1);
  EXPECT_TRUE(contains(contents(fs::path(said[2].str()) / "index.json"), "\"extra/last_words\""));

  const Preempted second =
      preempt(command(preempted, "--grace-period 0.05"), dir.path / "second.log", last_words + 3);
  EXPECT_EQ(second.exit_code, 128 + SIGTERM) << second.output;
  EXPECT_TRUE(
      contains(second.output, "resumed from " + checkpoint_dir_for_step(preempted, last_words)))
      << second.output;
  EXPECT_TRUE(
      contains(second.output, "the grace period of 0.05 s after the signal ran out: exiting now") ||
      contains(second.output, "preempted: last-words checkpoint"))
      << second.output;

  const ProgramRun resumed = run_program(command(preempted, ""));
  EXPECT_TRUE(contains(resumed.output, "is the last-words checkpoint of a run stopped by SIGTERM"))
      << resumed.output;
  EXPECT_EQ(verdict(resumed.output), verdict(reference.output)) << resumed.output;
  expect_same_checkpoint(straight, preempted, steps, 4);
}

// A file-size limit (`ulimit -f`, which some batch systems set) fails the save with an error
// naming the file and the limit, instead of SIGXFSZ killing the saving ranks without a word
// (exit 153); no checkpoint is left that could be loaded.
TEST(Trainer, AFileSizeLimitFailsTheSaveNamingTheFileAndTheLimit) {
  TempDir dir;
  const std::string save = (dir.path / "ckpt").string();
  // dash counts 512-byte blocks: 128 KiB, less than a rank's shard of the model and AdamW.
  const ProgramRun run =
      run_program("ulimit -f 256 && " + train_command(2, "1x2", "", "--steps 2 --save " + save));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(std::regex_search(
      run.output, std::regex("rank-0000[01]\\.safetensors: File too large \\(this process's "
                             "file-size limit, RLIMIT_FSIZE or `ulimit -f`, is 131072 bytes")))
      << run.output;
  EXPECT_FALSE(hp::latest_checkpoint(save).has_value()) << run.output;
  EXPECT_FALSE(fs::exists(checkpoint_dir_for_step(save, 2))) << run.output;
}

TEST(Trainer, ConfigFileFlagsAndBadInput) {
  TempDir dir;
  fs::create_directories(dir.path);
  std::ofstream(dir.path / "a_file") << "x";
  const std::string unwritable = (dir.path / "a_file" / "checkpoints").string();
  const ProgramRun run = train("", "--steps 10 --save " + unwritable);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(contains(run.output, "--save " + unwritable + ": rank 0 cannot write there"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "step ")) << run.output;

  // A config file, and a flag that overrides it.
  const std::string config = (dir.path / "run.toml").string();
  std::ofstream(config) << "steps = 5\nseq = 32\nlog-every = 1\n";
  const ProgramRun configured = train("", "--config " + config + " --steps 2");
  EXPECT_TRUE(contains(configured.output, "steps=2\n")) << configured.output;
  EXPECT_TRUE(contains(configured.output, "seq=32\n")) << configured.output;
  EXPECT_TRUE(contains(configured.output, "grace-period=25\n")) << configured.output;
  EXPECT_TRUE(contains(configured.output, "step      2/2")) << configured.output;

  const std::string missing = (dir.path / "no_such_corpus").string();
  const ProgramRun no_data = train("", "--steps 10 --data " + missing);
  EXPECT_EQ(no_data.exit_code, 2) << no_data.output;
  EXPECT_TRUE(contains(no_data.output, "--data: data path " + missing + ": no such file"))
      << no_data.output;
}

// --config files are read by a TOML parser, and every key must name an option; NaN and
// infinity are no numbers for any option. Each is a usage error (exit 2) before any step.
TEST(Trainer, MalformedConfigsUnknownKeysAndNonFiniteNumbersAreUsageErrors) {
  TempDir dir;
  fs::create_directories(dir.path);
  const std::string config = (dir.path / "run.toml").string();
  const auto parse = [&](const std::string& flags) {
    return run_program(std::string(TRAIN_DECODER_PATH) + corpus_flags() + flags);
  };
  const std::vector<std::pair<std::string, std::string>> configs = {
      {"steps = [1, 2\n", "--config: not valid TOML at line 1"},
      {"prompt = \"unclosed\n", "--config: not valid TOML at line 1"},
      {"[[[\n", "--config: not valid TOML at line 1"},
      {"steps = 3\nfree text\n", "--config: not valid TOML at line 2"},
      {"steps = 3\nstepz = 3\n", "--config: unknown key 'stepz' (line 2)"},
      {"[model]\ndim = 8\n", "--config: unknown key 'model' (line 1)"},
      {"lr = nan\n", "must be a finite number"}};
  for (const auto& [text, expected] : configs) {
    std::ofstream(config, std::ios::trunc) << text;
    const ProgramRun run = parse("--config " + config);
    EXPECT_EQ(run.exit_code, 2) << text << run.output;
    EXPECT_TRUE(contains(run.output, expected)) << text << run.output;
  }
  for (const std::string flag :
       {"--clip-grad nan", "--timeout nan", "--lr nan", "--lr inf", "--val-fraction nan",
        "--balance-loss nan", "--grace-period nan"}) {
    const ProgramRun run = parse(flag);
    EXPECT_EQ(run.exit_code, 2) << flag << run.output;
    EXPECT_TRUE(contains(run.output, "must be a finite number")) << flag << run.output;
  }
  const ProgramRun hp_run = run_program(std::string(HP_RUN_PATH) + " --timeout nan -- true");
  EXPECT_EQ(hp_run.exit_code, 2) << hp_run.output;
  EXPECT_TRUE(contains(hp_run.output, "must be a finite number")) << hp_run.output;
}

// Numbers out of an option's range are usage errors (exit 2) that name the rule, not a
// CLI11 range up to the largest double (all 309 digits); so are a negative fusion bucket
// and a --fail-rank beyond the ranks (exit 1 before).
TEST(Trainer, OutOfRangeNumbersAreShortUsageErrors) {
  const auto parse = [&](const std::string& flags) {
    return run_program(std::string(TRAIN_DECODER_PATH) + corpus_flags() + flags);
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--lr 0", "--lr: must be positive, got '0'"},
      {"--tp -2", "--tp: must be positive, got '-2'"},
      {"--clip-grad -1", "--clip-grad: must not be negative, got '-1'"},
      {"--fail-at-step 0", "--fail-at-step: must be positive, got '0'"},
      {"--comm-fusion-bucket -1", "--comm-fusion-bucket: must not be negative"}};
  for (const auto& [flags, message] : cases) {
    const ProgramRun run = parse(flags);
    EXPECT_EQ(run.exit_code, 2) << flags << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, message)) << flags << "\n" << run.output;
    EXPECT_FALSE(contains(run.output, "179769313486231")) << flags << "\n" << run.output;
  }
  const ProgramRun fail_rank = train("", "--steps 2 --fail-at-step 1 --fail-rank 9");
  EXPECT_EQ(fail_rank.exit_code, 2) << fail_rank.output;
  EXPECT_TRUE(contains(fail_rank.output, "--fail-rank 9: there are only 2 ranks"))
      << fail_rank.output;
}

// The values of `field` ("loss", "grad_norm"; full precision) of every logged step in
// `dir`/metrics.jsonl.
std::vector<double> logged(const std::string& dir, const std::string& field) {
  std::vector<double> values;
  std::ifstream metrics(dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    values.push_back(nlohmann::json::parse(line).at(field).get<double>());
  }
  return values;
}

// --tp 2 --cp 2 --ep 2 on 8 local ranks (MoE layers) trains the model the 2 data-parallel
// ranks train alone: the same losses and grad norms at every step, within rounding (2e-4
// and 2e-3; measured 1.1e-4 and 2.2e-4 at step 3). Three steps: AdamW and top-k routing
// make the runs drift apart later from rounding-level differences, 4e-4 in the loss by
// step 6; the exact checks are the layers' own tests.
TEST(Trainer, TensorContextAndExpertParallelTrainLikeDataParallel) {
  TempDir dir;
  const std::string plain_out = (dir.path / "plain").string();
  const std::string parallel_out = (dir.path / "parallel").string();
  const std::string flags = "--steps 3 --log-every 1 --experts 4 --out ";
  const ProgramRun plain = train("", flags + plain_out);
  const ProgramRun parallel = run_program(
      std::string(HP_RUN_PATH) + " -n 8 --timeout 120 -- " + TRAIN_DECODER_PATH + corpus_flags() +
      "--mesh 1x2 --tp 2 --cp 2 --ep 2 --batch 16 --lr 1e-2 --warmup 10 "
      "--eval-batches 4 " +
      flags + parallel_out);
  ASSERT_EQ(parallel.exit_code == 0, plain.exit_code == 0) << parallel.output;
  for (const auto& [field, tolerance] :
       {std::pair<std::string, double>{"loss", 2e-4}, {"grad_norm", 2e-3}}) {
    const std::vector<double> want = logged(plain_out, field), got = logged(parallel_out, field);
    ASSERT_EQ(want.size(), 3u) << plain.output;
    ASSERT_EQ(got.size(), want.size()) << parallel.output;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], tolerance) << field << " at step " << i + 1;
    }
  }
  EXPECT_TRUE(contains(parallel.output, "ranks 8,")) << parallel.output;

  const ProgramRun bad = train("", "--steps 2 --ep 3");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--ep (3) must divide the shards of --mesh (2)")) << bad.output;
  const ProgramRun no_experts = train("", "--steps 2 --top-k 2");
  EXPECT_EQ(no_experts.exit_code, 2) << no_experts.output;
  EXPECT_TRUE(contains(no_experts.output, "--top-k applies to MoE layers, and there are none"))
      << no_experts.output;
  const ProgramRun wrong_world = train("", "--steps 2 --tp 2");
  EXPECT_EQ(wrong_world.exit_code, 2) << wrong_world.output;
  EXPECT_TRUE(contains(wrong_world.output,
                       "--mesh 1x2 x --cp 1 x --tp 2 needs 4 ranks, this "
                       "run has 2"))
      << wrong_world.output;
}

// With a learning rate of 1e30 the first update sends the weights to about 1e30, and the
// next steps' gradient norms are NaN: each such step makes no update on any rank (logged
// as skipped, with a null norm), no checkpoint holds an inf or NaN weight, and the second
// in a row stops the run with an error naming --max-skipped-steps.
TEST(Trainer, NonFiniteStepsAreSkippedEverywhereAndStopTheRunAfterTheLimit) {
  TempDir dir;
  const std::string out = (dir.path / "out").string();
  const std::string save = (dir.path / "save").string();
  const ProgramRun run = run_program(
      std::string(HP_RUN_PATH) + " -n 2 --timeout 120 -- " + TRAIN_DECODER_PATH + corpus_flags() +
      "--mesh 1x2 --batch 16 --lr 1e30 --warmup 0 --eval-batches 4 --steps 8 --log-every 1 "
      "--max-skipped-steps 2 --save-every 1 --save " +
      save + " --out " + out);
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output, "step 2 skipped (no update): loss ")) << run.output;
  EXPECT_TRUE(contains(run.output, "--max-skipped-steps 2: steps 2 to 3 all had a non-finite"))
      << run.output;
  std::ifstream metrics(out + "/metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(metrics, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u) << run.output;
  EXPECT_FALSE(lines[0].value("skipped", false));
  EXPECT_TRUE(lines[1].value("skipped", false));
  EXPECT_TRUE(lines[1].at("grad_norm").is_null());
  int checkpoints = 0;
  for (const auto& entry : fs::directory_iterator(save)) {
    if (!is_complete_checkpoint(entry.path())) continue;
    ++checkpoints;
    const std::string whole = (dir.path / "whole.pt").string();
    convert_to_full_checkpoint(entry.path(), whole);
    for (const auto& item : read_state_dict_file(whole)) {
      EXPECT_TRUE(item.value().isfinite().all().item<bool>()) << entry.path() << " " << item.key();
    }
  }
  EXPECT_EQ(checkpoints, 2) << run.output;  // steps 1 and 2 (whose update was skipped)
}

TEST(Trainer, TimeoutFlagNamesARankThatNeverStarts) {
  // Rank 0 of 2 alone; --timeout wins over the environment's 600 s.
  const auto start = std::chrono::steady_clock::now();
  const ProgramRun run =
      run_program("env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                  std::to_string(find_free_port()) + " HP_TIMEOUT_S=600 " + TRAIN_DECODER_PATH +
                  corpus_flags() + "--mesh 1x2 --timeout 3");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output,
                       "train_decoder: error: start-up join of 2 ranks timed out after 3 s: rank "
                       "1 of 2 did not arrive"))
      << run.output;
  EXPECT_FALSE(contains(run.output, "frame #")) << run.output;
  // Far below HP_TIMEOUT_S (600 s); the wall time includes starting a loaded process.
  EXPECT_LT(seconds, 60.0) << run.output;
}

// torchrun proper (torch.distributed.run of the installed Python torch, through
// tools/torchrun.py where that torch lacks libuv): its agent hosts the store on
// MASTER_PORT, and a rank that fails makes it restart both, which resume and finish.
TEST(Trainer, TorchrunLaunchesAndRestartsTheTrainer) {
  const ProgramRun probe = run_program("python3 -c 'import torch.distributed.run'");
  if (probe.exit_code != 0) {
    GTEST_SKIP() << "torchrun is not available: python3 cannot import torch.distributed.run "
                    "(install PyTorch, e.g. Debian's python3-torch): "
                 << probe.output;
  }
  TempDir dir;
  const std::string save = (dir.path / "checkpoints").string();
  const ProgramRun run = run_program(
      "OMP_NUM_THREADS=1 python3 " + std::string(HP_SOURCE_DIR) +
      "/tools/torchrun.py --nproc-per-node 2 --max-restarts 1 --master-port " +
      std::to_string(find_free_port()) + " --no-python " + TRAIN_DECODER_PATH + corpus_flags() +
      "--mesh 1x2 --batch 16 --lr 1e-2 --warmup 10 --eval-batches 4 "
      "--sample-bytes 40 --timeout 60 --steps 60 --save-every 20 --resume auto --fail-at-step 45 "
      "--require-learning --save " +
      save);
  // 60 steps may or may not get below the unigram baseline; torchrun passes the verdict on.
  const bool learned = contains(run.output, "OK: validation loss");
  EXPECT_TRUE(learned || contains(run.output, "FAILED: validation loss")) << run.output;
  EXPECT_EQ(run.exit_code, learned ? 0 : 1) << run.output;
  for (const std::string& line :
       {std::string("--fail-at-step 45: failing on purpose"),
        "resumed from " + save + "/step-00000040 after 40 steps", std::string("step     60/60")}) {
    EXPECT_TRUE(contains(run.output, line)) << line << "\n" << run.output;
  }
  EXPECT_FALSE(contains(run.output, "Address already in use")) << run.output;
  EXPECT_TRUE(fs::exists(fs::path(save) / "step-00000060" / "COMPLETE")) << run.output;
}

// --pp 2 on 4 ranks (a 1x2 data-parallel mesh per stage) learns below the unigram
// baseline, samples through the stages, keeps both copies of the tied embedding bitwise
// equal, and says its schedule in the resolved configuration.
TEST(Trainer, PipelineParallelLearnsAndSaysItsSchedule) {
  const ProgramRun run = run_program(
      train_command(4, "1x2", "", "--pp 2 --pp-schedule 1f1b --steps 60 --require-learning"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "OK: validation loss ")) << run.output;
  for (const std::string& line :
       {"pp=2", "pp-schedule=\"1f1b\"", "microbatches=4", "virtual-stages=1",
        "  pipeline: 2 stages over 2 ranks, schedule 1f1b, 4 microbatches",
        "tied embedding: the first and last stages' copies are bitwise equal", "sample:"}) {
    EXPECT_TRUE(contains(run.output, std::string("[rank 0] ") + line)) << line << "\n"
                                                                       << run.output;
  }
}

// GPipe, 1F1B and interleaved 1F1B run the same arithmetic: the same losses bit for bit;
// and within rounding (the microbatches' gradients summed in another order) those of the
// same data-parallel layout without a pipeline.
TEST(Trainer, PipelineSchedulesTrainAlikeAndLikeDataParallel) {
  TempDir dir;
  const std::string flags = "--steps 10 --log-every 1 --layers 4 --out ";
  const auto losses = [&](int ranks, const std::string& name, const std::string& pp_flags) {
    const std::string out = (dir.path / name).string();
    const ProgramRun run = run_program(train_command(ranks, "1x2", "", pp_flags + flags + out));
    EXPECT_NE(verdict(run.output), "") << run.output;
    return logged(out, "loss");
  };
  const std::vector<double> plain = losses(2, "plain", "");
  const std::vector<double> gpipe = losses(4, "gpipe", "--pp 2 --pp-schedule gpipe ");
  ASSERT_EQ(plain.size(), 10u);
  EXPECT_EQ(losses(4, "1f1b", "--pp 2 --pp-schedule 1f1b "), gpipe);
  EXPECT_EQ(losses(4, "interleaved", "--pp 2 --pp-schedule interleaved --virtual-stages 2 "),
            gpipe);
  ASSERT_EQ(gpipe.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(gpipe[i], plain[i], 1e-4 * plain[i]) << "step " << i + 1;
  }
}

// --pp 2 with --tp 2 and --cp 2 (8 ranks, a one-rank data-parallel mesh per stage, slice
// and sequence part) trains like one rank alone on the same batches: the same losses and
// grad norms within rounding, the same validation loss and sample (through the stages, the
// sequence parts and the vocabulary slices), the tied embedding's copies bitwise equal at
// the end; its checkpoint resumes on one rank and continues like it.
TEST(Trainer, PipelineWithTensorAndContextParallelTrainsLikeOneRank) {
  TempDir dir;
  const auto path = [&](const std::string& name) { return (dir.path / name).string(); };
  const std::string flags = "--steps 10 --log-every 1 --layers 4 --save-every 5 --save ";
  const ProgramRun plain =
      run_program(train_command(1, "1x1", "", flags + path("plain") + " --out " + path("plain")));
  const ProgramRun parallel = run_program(train_command(
      8, "1x1", "",
      "--pp 2 --tp 2 --cp 2 " + flags + path("parallel") + " --out " + path("parallel")));
  ASSERT_NE(verdict(plain.output), "") << plain.output;
  EXPECT_EQ(verdict(parallel.output), verdict(plain.output)) << parallel.output;
  const auto sample = [](const std::string& output) {
    const size_t start = output.find("[rank 0] sample:\n");
    return start == std::string::npos ? ""
                                      : output.substr(start, output.find('\n', start + 18) - start);
  };
  EXPECT_NE(sample(plain.output), "") << plain.output;
  EXPECT_EQ(sample(parallel.output), sample(plain.output));
  EXPECT_TRUE(contains(parallel.output,
                       "tied embedding: the first and last stages' copies are bitwise equal"))
      << parallel.output;
  for (const std::string field : {"loss", "grad_norm"}) {
    const std::vector<double> want = logged(path("plain"), field),
                              got = logged(path("parallel"), field);
    ASSERT_EQ(want.size(), 10u) << plain.output;
    ASSERT_EQ(got.size(), want.size()) << parallel.output;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-4 * want[i]) << field << " at step " << i + 1;
    }
  }
  const std::string checkpoint = checkpoint_dir_for_step(path("parallel"), 5);
  const ProgramRun resumed = run_program(train_command(
      1, "1x1", "",
      "--steps 10 --log-every 1 --layers 4 --resume " + checkpoint + " --out " + path("resumed")));
  EXPECT_TRUE(contains(resumed.output, "resumed from " + checkpoint + " after 5 steps"))
      << resumed.output;
  const std::vector<double> want = logged(path("parallel"), "loss"),
                            got = logged(path("resumed"), "loss");
  ASSERT_EQ(got.size(), 5u) << resumed.output;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i + 5], 1e-4 * want[i + 5]) << "step " << i + 6;
  }
}

// --pp 2 with MoE layers split over --ep 2 (4 ranks) trains like the same mesh without a
// pipeline (2 ranks): each stage's balancing loss goes backward with its microbatch, so with
// one microbatch the losses, balancing losses (logged, and printed with each step) and grad
// norms agree within rounding (measured over 6 steps: losses equal, balancing losses within
// 1.4e-7 and grad norms within 6e-9 relative; without the balancing loss the grad norm
// moves by 3e-3). Its checkpoint, experts split over the ep ranks in each stage, resumes
// without --pp continuing like it, and under --pp ending with its checkpoint byte for byte.
TEST(Trainer, PipelineWithExpertParallelTrainsLikeWithoutAndResumes) {
  TempDir dir;
  const auto path = [&](const std::string& name) { return (dir.path / name).string(); };
  const std::string flags =
      "--steps 6 --log-every 1 --layers 4 --experts 4 --ep 2 --balance-loss 0.1 ";
  const std::string pp = "--pp 2 --microbatches 1 ";
  const ProgramRun plain =
      run_program(train_command(2, "1x2", "", flags + "--out " + path("plain")));
  const ProgramRun pipelined = run_program(train_command(
      4, "1x2", "",
      pp + flags + "--save-every 3 --save " + path("saved") + " --out " + path("pp")));
  // Six steps end above the unigram baseline (exit 1): what matters is that both ran through.
  ASSERT_NE(verdict(plain.output), "") << plain.output;
  ASSERT_NE(verdict(pipelined.output), "") << pipelined.output;
  EXPECT_TRUE(std::regex_search(pipelined.output,
                                std::regex("step +1/6  loss [0-9.]+  balance 0\\.[0-9]{4}  grad")))
      << pipelined.output;
  const auto expect_near = [&](const std::string& expected, const std::string& actual) {
    for (const std::string field : {"loss", "balance_loss", "grad_norm"}) {
      std::vector<double> want = logged(expected, field);
      const std::vector<double> got = logged(actual, field);
      ASSERT_GE(want.size(), got.size()) << field;
      want.erase(want.begin(), want.end() - static_cast<std::ptrdiff_t>(got.size()));
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << field << " at step " << 7 - got.size() + i;
      }
    }
  };
  ASSERT_EQ(logged(path("pp"), "loss").size(), 6u) << pipelined.output;
  expect_near(path("plain"), path("pp"));

  const std::string checkpoint = checkpoint_dir_for_step(path("saved"), 3);
  const ProgramRun resumed = run_program(
      train_command(2, "1x2", "", flags + "--resume " + checkpoint + " --out " + path("resumed")));
  EXPECT_TRUE(contains(resumed.output, "resumed from " + checkpoint + " after 3 steps"))
      << resumed.output;
  ASSERT_EQ(logged(path("resumed"), "loss").size(), 3u) << resumed.output;
  expect_near(path("pp"), path("resumed"));
  const ProgramRun again = run_program(train_command(
      4, "1x2", "", pp + flags + "--resume " + checkpoint + " --save " + path("again")));
  ASSERT_NE(verdict(again.output), "") << again.output;
  expect_same_checkpoint(path("saved"), path("again"), 6, 4);
}

// --pp 2 checkpoints hold the whole decoder, each stage's part under the whole model's
// names: a rank killed mid-run restarts from one and ends with the uninterrupted run's
// checkpoint (index and 4 rank files) byte for byte. A pipeline's checkpoint resumes without
// --pp and one saved without --pp resumes under --pp: each continues like the run that
// saved it, within the rounding between the two layouts. --export under --pp (converted
// from the final checkpoint, or from one the stages write for it) holds the tensors the
// same checkpoint exports without --pp, bitwise.
TEST(Trainer, PipelineCheckpointsRestartBitwiseAndMoveBetweenLayouts) {
  TempDir dir;
  const int64_t steps = 16, saved_step = 8;
  const std::string flags =
      "--layers 4 --steps 16 --log-every 1 --save-every 8 --resume auto --save ";
  const std::string pp = "--pp 2 --pp-schedule 1f1b ";
  const auto path = [&](const std::string& name) { return (dir.path / name).string(); };
  const auto run = [&](int ranks, const std::string& hp_run_flags, const std::string& more) {
    return run_program(train_command(ranks, "1x2", hp_run_flags, more));
  };

  const ProgramRun straight =
      run(4, "",
          pp + flags + path("pp") + " --out " + path("pp_out") + " --export " + path("pp_export"));
  ASSERT_NE(verdict(straight.output), "") << straight.output;
  const ProgramRun restarted =
      run(4, "--max-restarts 1",
          pp + flags + path("pp_restarted") + " --fail-by-kill --fail-at-step 12 --fail-rank 3");
  EXPECT_TRUE(contains(
      restarted.output,
      "resumed from " + checkpoint_dir_for_step(path("pp_restarted"), 8) + " after 8 steps"))
      << restarted.output;
  EXPECT_EQ(verdict(restarted.output), verdict(straight.output));
  expect_same_checkpoint(path("pp"), path("pp_restarted"), steps, 4);

  const ProgramRun plain = run(2, "", flags + path("plain") + " --out " + path("plain_out"));
  ASSERT_NE(verdict(plain.output), "") << plain.output;
  // Each layout resumed from the other's checkpoint of step 8.
  const auto resumed_losses = [&](int ranks, const std::string& layout, const std::string& from,
                                  const std::string& name) {
    const std::string checkpoint = checkpoint_dir_for_step(path(from), saved_step);
    const ProgramRun resumed = run(ranks, "",
                                   layout + "--layers 4 --steps 16 --log-every 1 --resume " +
                                       checkpoint + " --out " + path(name));
    EXPECT_TRUE(contains(resumed.output, "resumed from " + checkpoint + " after 8 steps"))
        << resumed.output;
    EXPECT_NE(verdict(resumed.output), "") << resumed.output;
    return logged(path(name), "loss");
  };
  const auto expect_continues = [&](const std::vector<double>& resumed,
                                    const std::vector<double>& saver) {
    ASSERT_EQ(saver.size(), static_cast<size_t>(steps));
    ASSERT_EQ(resumed.size(), static_cast<size_t>(steps - saved_step));
    for (size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_NEAR(resumed[i], saver[saved_step + i], 1e-4 * saver[saved_step + i])
          << "step " << saved_step + i + 1;
    }
  };
  expect_continues(resumed_losses(2, "", "pp", "plain_from_pp"), logged(path("pp_out"), "loss"));
  expect_continues(resumed_losses(4, pp, "plain", "pp_from_plain"),
                   logged(path("plain_out"), "loss"));

  // The pipeline's last checkpoint exported by runs that take no step: without --pp
  // (gathered), and under --pp without --save (the stages' checkpoint kept in the export
  // directory meanwhile).
  const std::string last = checkpoint_dir_for_step(path("pp"), steps);
  for (const auto& [layout, ranks, name] :
       {std::tuple<std::string, int, std::string>{"", 2, "plain_export"},
        {pp, 4, "pp_staged_export"}}) {
    const ProgramRun exported = run(
        ranks, "", layout + "--layers 4 --steps 16 --resume " + last + " --export " + path(name));
    ASSERT_NE(verdict(exported.output), "") << exported.output;
    EXPECT_FALSE(fs::exists(path(name) + "/.stages")) << name;
  }
  for (const std::string file : {"/model.pt", "/optim.pt"}) {
    const StateDict want = read_state_dict_file(path("plain_export") + file);
    for (const std::string name : {"pp_export", "pp_staged_export"}) {
      const StateDict got = read_state_dict_file(path(name) + file);
      EXPECT_EQ(got.size(), want.size()) << name << file;
      for (const auto& item : want) {
        const at::Tensor* tensor = got.find(item.key());
        EXPECT_TRUE(tensor && tensor->dtype() == item.value().dtype() &&
                    torch::equal(*tensor, item.value()))
            << name << file << ": " << item.key();
      }
    }
  }
}

// int8 weight all-gathers and gradient reduce-scatters on 2 ranks: the final validation
// loss within 1% of full precision's (also with error feedback) and the warm-up steps'
// losses within 0.5% (later, at
// the peak learning rate, one run may spike where the other does not), not equal to them
// (something was quantized), and a rerun gives them again bit for bit; the resolved
// configuration shows the codecs. With error feedback, a rank killed mid-run resumes from
// the checkpoint (which keeps the residuals) and ends with the uninterrupted run's files.
TEST(Trainer, QuantizedCollectivesTrainCloseToFullPrecisionAndRerunBitwise) {
  TempDir dir;
  const std::string flags = "--steps 20 --log-every 1 --out ";
  const auto run_with = [&](const std::string& name, const std::string& codec_flags) {
    const std::string out = (dir.path / name).string();
    const ProgramRun run = run_program(train_command(2, "1x2", "", codec_flags + flags + out));
    EXPECT_NE(verdict(run.output), "") << run.output;
    return std::make_pair(run.output, logged(out, "loss"));
  };
  const auto [plain_output, plain] = run_with("plain", "");
  const std::string int8 = "--ag-codec int8 --rs-codec int8 ";
  const auto [output, quantized] = run_with("int8", int8);
  EXPECT_EQ(run_with("int8-again", int8).second, quantized) << "a rerun differs";
  for (const std::string line : {"ag-codec=\"int8\"", "rs-codec=\"int8\"", "codec-block=256"}) {
    EXPECT_TRUE(contains(output, "[rank 0] " + line)) << line << "\n" << output;
  }
  ASSERT_EQ(plain.size(), 20u);
  ASSERT_EQ(quantized.size(), plain.size());
  EXPECT_NE(quantized, plain);
  for (size_t i = 0; i < 10; ++i) {  // --warmup 10
    EXPECT_NEAR(quantized[i], plain[i], 0.005 * plain[i]) << "step " << i + 1;
  }
  const auto validation_loss = [](const std::string& output) {
    const std::string line = verdict(output);
    return line.empty() ? 0.0 : std::stod(line.substr(std::string("validation loss ").size()));
  };
  const double full_precision = validation_loss(plain_output);
  ASSERT_GT(full_precision, 0) << plain_output;
  EXPECT_NEAR(validation_loss(output), full_precision, 0.01 * full_precision) << output;
  const std::string feedback = int8 + "--error-feedback --save-every 10 --resume auto --save ";
  const std::string straight = (dir.path / "ef-straight").string();
  const std::string feedback_output = run_with("int8-ef", feedback + straight + " ").first;
  EXPECT_TRUE(contains(feedback_output, "[rank 0] error-feedback=true")) << feedback_output;
  EXPECT_NEAR(validation_loss(feedback_output), full_precision, 0.01 * full_precision)
      << feedback_output;
  const std::string restarted = (dir.path / "ef-restarted").string();
  const ProgramRun resumed = train(
      "--max-restarts 1", feedback + restarted + " --fail-by-kill --fail-at-step 15 " +
                              "--fail-rank 1 --steps 20 --out " + (dir.path / "ef-r").string());
  EXPECT_TRUE(contains(resumed.output, "resumed from " + checkpoint_dir_for_step(restarted, 10)))
      << resumed.output;
  EXPECT_EQ(verdict(resumed.output), verdict(feedback_output)) << resumed.output;
  expect_same_checkpoint(straight, restarted, 20, 2);
}

// --comm-fusion-bucket reaches fully_shard: in full precision the buckets move the same
// values (the same losses), with int8 each bucket's blocks start at its first parameter
// (other losses). Without --comm-fusion, or with a size that is not one, it is a usage error.
TEST(Trainer, CommFusionBucketsMoveTheSameValues) {
  TempDir dir;
  const auto losses_of = [&](const std::string& name, const std::string& flags) {
    const std::string out = (dir.path / name).string();
    const ProgramRun run =
        train("", "--steps 3 --log-every 1 --comm-fusion " + flags + " --out " + out);
    EXPECT_NE(verdict(run.output), "") << run.output;
    return std::make_pair(run.output, logged(out, "loss"));
  };
  const std::string int8 = "--ag-codec int8 --rs-codec int8 --codec-block 64";
  const auto [output, bucketed] = losses_of("bucketed", "--comm-fusion-bucket 4KiB");
  EXPECT_TRUE(contains(output, "[rank 0] comm-fusion-bucket=4096")) << output;
  ASSERT_EQ(bucketed.size(), 3u);
  EXPECT_EQ(bucketed, losses_of("whole", "").second);
  EXPECT_NE(losses_of("bucketed-int8", "--comm-fusion-bucket 4KiB " + int8).second,
            losses_of("whole-int8", int8).second);
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--comm-fusion-bucket 4KiB",
            "--comm-fusion-bucket sizes the collectives of "
            "--comm-fusion: give --comm-fusion"},
           {"--comm-fusion --comm-fusion-bucket lots", "--comm-fusion-bucket"}}) {
    const ProgramRun run = train("", "--steps 2 " + flags);
    EXPECT_EQ(run.exit_code, 2) << flags << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, message)) << flags << "\n" << run.output;
  }
}

TEST(Trainer, CodecMisuseIsAUsageError) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--ag-codec int4", "--ag-codec: int4 not in {none,int8,fp8}"},
      {"--codec-block 64", "--codec-block applies to quantized collectives"},
      {"--rs-codec int8 --codec-block 0", "--codec-block: Value 0 not in range"},
      {"--ag-codec int8 --error-feedback",
       "--error-feedback carries the quantized "
       "reduce-scatter's residual: give --rs-codec"}};
  for (const auto& [flags, message] : cases) {
    const ProgramRun run = train("", "--steps 2 " + flags);
    EXPECT_EQ(run.exit_code, 2) << flags << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, message)) << flags << "\n" << run.output;
  }
  const ProgramRun one_shard =
      run_program(train_command(2, "2x1", "", "--steps 2 --ag-codec int8"));
  EXPECT_EQ(one_shard.exit_code, 2) << one_shard.output;
  EXPECT_TRUE(contains(one_shard.output, "there is one shard: nothing would be quantized"))
      << one_shard.output;
}

// What --pp cannot do, or not yet, is a usage error naming the fix.
TEST(Trainer, PipelineMisuseIsAUsageError) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--pp 2 --layers 3", "--layers (3) must be divisible into --pp x --virtual-stages = 2"},
      {"--pp 2 --microbatches 3",
       "--microbatches (3) must divide the batch per data-parallel "
       "rank (--batch 16 / 2 = 8)"},
      {"--pp 2 --layers 4 --pp-schedule interleaved --virtual-stages 2 --microbatches 1",
       "--pp-schedule interleaved needs --microbatches (1) to be a multiple of --pp (2)"},
      {"--pp 2 --pp-schedule interleaved", "needs --virtual-stages >= 2"},
      {"--pp 2 --virtual-stages 2", "--virtual-stages 2 needs --pp-schedule interleaved"},
      {"--pp 2 --pp-schedule zero-bubble", "--pp-schedule zero-bubble is not available"},
      {"--microbatches 2", "they need --pp >= 2"},
      {"--pp 2 --rs-codec int8 --error-feedback --resume auto --save ckpt",
       "--pp with --error-feedback does not compose with --save or --resume yet"},
      {"--pp 2", "--pp 2 x --mesh 1x2 x --cp 1 x --tp 1 needs 4 ranks, this run has 2"}};
  for (const auto& [flags, message] : cases) {
    const ProgramRun run = train("", "--steps 2 " + flags);
    EXPECT_EQ(run.exit_code, 2) << flags << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, message)) << flags << "\n" << run.output;
  }
}

}  // namespace
}  // namespace hp::testing
