#pragma once
// A byte-level text corpus: the text files under some paths, each split into a training
// part (its beginning) and a validation part (its end), so that both see every kind of
// file. Bytes are read from the files on demand: a rank reads only what it asks for.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace hp::trainer {

enum class Split { kTrain, kValidation };

class TextCorpus {
 public:
  // `paths`: text files and directories, searched recursively (entries whose name starts
  // with '.' are skipped, and files that are not text: a NUL byte in their first 8 KiB).
  // Throws std::invalid_argument naming the path when one is missing, a file given by
  // name is not text, or nothing to train on is left (no text files, or too few bytes).
  TextCorpus(const std::vector<std::string>& paths, double validation_fraction);

  int64_t size(Split split) const;
  // Bytes [offset, offset + length) of a split, as int64 tokens (0..255). The parts of
  // the files follow each other in path order.
  at::Tensor read(Split split, int64_t offset, int64_t length) const;
  // How often each byte value occurs in [offset, offset + length) of a split.
  std::array<int64_t, 256> byte_counts(Split split, int64_t offset, int64_t length) const;

  const std::vector<std::string>& files() const { return files_; }

 private:
  struct Part {
    size_t file;          // index into files_
    int64_t file_offset;  // where the part starts in its file
    int64_t start;        // where it starts in its split
    int64_t size;
  };
  template <typename Visit>
  void visit(Split split, int64_t offset, int64_t length, Visit&& visit_bytes) const;

  std::vector<std::string> files_;
  std::vector<Part> parts_[2];
  int64_t sizes_[2] = {0, 0};
};

}  // namespace hp::trainer
