// The trainer's data: text files split into training and validation parts, windows dealt
// out to the data-parallel ranks (disjoint, together the whole epoch), the same batches
// for the same (seed, step) so that a resumed run sees what an uninterrupted one would,
// and clear errors for data paths that hold no text.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "error_of.h"
#include "trainer/text_batches.h"
#include "trainer/text_corpus.h"

namespace hp::trainer {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("hp_text_data_" + std::to_string(getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string write(const std::string& name, const std::string& contents) const {
    const fs::path file = path / name;
    fs::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary) << contents;
    return file.string();
  }
};

std::string random_text(size_t length, uint32_t seed) {
  std::mt19937 random(seed);
  std::string text;
  for (size_t i = 0; i < length; ++i) text += static_cast<char>('a' + random() % 26);
  return text;
}

std::string text_of(const at::Tensor& tokens) {
  std::string text;
  for (int64_t i = 0; i < tokens.numel(); ++i) text += static_cast<char>(tokens[i].item<int64_t>());
  return text;
}

TEST(TextCorpus, EveryFileEndsInTheValidationPart) {
  TempDir dir;
  dir.write("b.txt", "0123456789");
  dir.write("a/x.md", "abcdefghij");
  dir.write(".hidden/skipped.txt", "hidden text");
  dir.write("binary.bin", std::string("\x7f"
                                      "ELF\0\0",
                                      6));
  const TextCorpus corpus({dir.path.string()}, 0.2);
  ASSERT_EQ(corpus.files().size(), 2u);  // a/x.md, b.txt: sorted, hidden and binary skipped
  EXPECT_EQ(text_of(corpus.read(Split::kTrain, 0, corpus.size(Split::kTrain))), "abcdefgh01234567");
  EXPECT_EQ(text_of(corpus.read(Split::kValidation, 0, corpus.size(Split::kValidation))), "ij89");
  EXPECT_EQ(text_of(corpus.read(Split::kTrain, 6, 4)), "gh01");  // across files
  const auto counts = corpus.byte_counts(Split::kTrain, 0, corpus.size(Split::kTrain));
  EXPECT_EQ(counts['a'], 1);
  EXPECT_EQ(counts['9'], 0);
}

// 3 ranks, 2 windows each per step: over one epoch the ranks' windows are disjoint and
// together every window but the remainder beyond a multiple of 3.
TEST(TrainBatches, RanksShareTheEpochDisjointly) {
  TempDir dir;
  dir.write("a.txt", random_text(4000, 1));
  dir.write("b.txt", random_text(3000, 2));
  auto corpus = std::make_shared<TextCorpus>(std::vector<std::string>{dir.path.string()}, 0.1);
  constexpr int64_t kSeq = 16, kRanks = 3, kBatch = 2;
  TextWindows windows(corpus, Split::kTrain, kSeq);
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < *windows.size(); ++i) index_of[text_of(windows.get(i).data)] = i;
  ASSERT_EQ(index_of.size(), *windows.size());  // random text: every window is distinct

  std::set<size_t> seen;
  int64_t dealt = 0;
  for (int64_t rank = 0; rank < kRanks; ++rank) {
    TrainBatches batches(corpus, kSeq, kBatch, rank, kRanks, 7);
    for (int64_t step = 1; step <= batches.steps_per_epoch(); ++step) {
      const Batch batch = batches.at_step(step);
      ASSERT_EQ(batch.data.sizes(), (std::vector<int64_t>{kBatch, kSeq}));
      EXPECT_TRUE(
          torch::equal(batch.data.narrow(1, 1, kSeq - 1), batch.target.narrow(1, 0, kSeq - 1)));
      for (int64_t row = 0; row < kBatch; ++row) {
        seen.insert(index_of.at(text_of(batch.data[row])));
        ++dealt;
      }
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), dealt) << "a window was dealt twice";
  const auto total = static_cast<int64_t>(*windows.size());
  EXPECT_GT(dealt, total - kRanks * kBatch) << "more than the remainder left out";
}

// Batches depend on (seed, step) only: a fresh sampler asked from step k on gives what
// one that ran from step 1 gave, in the first epoch and after it; epochs differ in order.
TEST(TrainBatches, ResumingAtAStepReproducesItsBatches) {
  TempDir dir;
  dir.write("a.txt", random_text(3000, 3));
  auto corpus = std::make_shared<TextCorpus>(std::vector<std::string>{dir.path.string()}, 0.1);
  TrainBatches straight(corpus, 16, 4, 1, 2, 11);
  const int64_t epoch = straight.steps_per_epoch();
  ASSERT_GE(epoch, 3);
  std::vector<Batch> expected;
  for (int64_t step = 1; step <= 2 * epoch + 2; ++step) expected.push_back(straight.at_step(step));
  for (int64_t resume : {int64_t{2}, epoch, epoch + 2}) {
    TrainBatches resumed(corpus, 16, 4, 1, 2, 11);
    for (int64_t step = resume; step <= 2 * epoch + 2; ++step) {
      EXPECT_TRUE(torch::equal(resumed.at_step(step).data, expected[step - 1].data))
          << "resumed at " << resume << ", step " << step;
    }
  }
  EXPECT_FALSE(torch::equal(expected[0].data, expected[epoch].data)) << "epochs in one order";
  TrainBatches other_seed(corpus, 16, 4, 1, 2, 12);
  EXPECT_FALSE(torch::equal(other_seed.at_step(1).data, expected[0].data));
}

TEST(TextCorpus, PathsWithoutTextAreRefused) {
  TempDir dir;
  const std::string missing = (dir.path / "missing").string();
  EXPECT_NE(error_of([&] { TextCorpus({missing}, 0.1); }).find(missing + ": no such file"),
            std::string::npos);
  const std::string empty = dir.write("empty.txt", "");
  EXPECT_NE(error_of([&] { TextCorpus({empty}, 0.1); }).find(empty + " is empty"),
            std::string::npos);
  const std::string binary = dir.write("data.bin", std::string("ab\0cd", 5));
  EXPECT_NE(error_of([&] { TextCorpus({binary}, 0.1); }).find(binary + " is not a text file"),
            std::string::npos);
  const std::string only_binary = (dir.path / "only_binary").string();
  dir.write("only_binary/x.bin", std::string("\0\0\0", 3));
  EXPECT_NE(error_of([&] {
              TextCorpus({only_binary}, 0.1);
            }).find("0 text files (1 others skipped), too little text"),
            std::string::npos);
  // Text, but too short for one window per rank.
  const std::string tiny = dir.write("tiny.txt", "just a few words here");
  auto corpus = std::make_shared<TextCorpus>(std::vector<std::string>{tiny}, 0.1);
  EXPECT_NE(error_of([&] {
              TrainBatches(corpus, 16, 2, 0, 2, 0);
            }).find("the training text holds 1 sequences of 17 bytes, 4 needed"),
            std::string::npos);
}

}  // namespace
}  // namespace hp::trainer
