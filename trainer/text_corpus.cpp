#include "trainer/text_corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace hp::trainer {
namespace {

namespace fs = std::filesystem;

// Text as git decides it: no NUL byte near the start.
bool is_text(const fs::path& file) {
  std::ifstream stream(file, std::ios::binary);
  char head[8192];
  stream.read(head, sizeof head);
  return std::find(head, head + stream.gcount(), '\0') == head + stream.gcount();
}

bool hidden(const fs::path& path) { return path.filename().string().starts_with("."); }

}  // namespace

TextCorpus::TextCorpus(const std::vector<std::string>& paths, double validation_fraction) {
  if (paths.empty()) throw std::invalid_argument("no data path given");
  if (!(validation_fraction > 0 && validation_fraction < 1)) {
    throw std::invalid_argument("the validation fraction must be in (0, 1), got " +
                                std::to_string(validation_fraction));
  }
  int64_t skipped = 0;
  for (const std::string& path : paths) {
    std::error_code error;
    const fs::file_status status = fs::status(path, error);
    if (!fs::exists(status)) {
      throw std::invalid_argument("data path " + path + ": no such file or directory");
    }
    if (fs::is_regular_file(status)) {
      if (!is_text(path)) {
        throw std::invalid_argument("data path " + path +
                                    " is not a text file (a NUL byte in its first 8 KiB); give "
                                    "text files or directories of them");
      }
      if (fs::file_size(path) == 0) throw std::invalid_argument("data path " + path + " is empty");
      files_.push_back(path);
      continue;
    }
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(path); it != fs::recursive_directory_iterator();
         ++it) {
      if (hidden(it->path())) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file() || it->file_size() == 0) continue;
      if (is_text(it->path())) {
        found.push_back(it->path().string());
      } else {
        ++skipped;
      }
    }
    std::sort(found.begin(), found.end());  // the same order on every rank and run
    files_.insert(files_.end(), found.begin(), found.end());
  }
  for (size_t i = 0; i < files_.size(); ++i) {
    const auto size = static_cast<int64_t>(fs::file_size(files_[i]));
    const auto validation = static_cast<int64_t>(static_cast<double>(size) * validation_fraction);
    const int64_t train = size - validation;
    parts_[0].push_back({i, 0, sizes_[0], train});
    sizes_[0] += train;
    if (validation > 0) {
      parts_[1].push_back({i, train, sizes_[1], validation});
      sizes_[1] += validation;
    }
  }
  if (sizes_[0] == 0 || sizes_[1] == 0) {
    std::string list;
    for (const auto& path : paths) list += (list.empty() ? "" : ", ") + path;
    throw std::invalid_argument("data paths " + list + ": " + std::to_string(files_.size()) +
                                " text files (" + std::to_string(skipped) +
                                " others skipped), too little text for a training and a "
                                "validation part");
  }
}

int64_t TextCorpus::size(Split split) const { return sizes_[static_cast<int>(split)]; }

template <typename Visit>
void TextCorpus::visit(Split split, int64_t offset, int64_t length, Visit&& visit_bytes) const {
  const std::vector<Part>& parts = parts_[static_cast<int>(split)];
  if (offset < 0 || length < 0 || offset + length > size(split)) {
    throw std::out_of_range("bytes " + std::to_string(offset) + "+" + std::to_string(length) +
                            " outside a split of " + std::to_string(size(split)));
  }
  // The last part starting at or before `offset`.
  auto part = std::upper_bound(parts.begin(), parts.end(), offset,
                               [](int64_t at, const Part& p) { return at < p.start; }) -
              1;
  std::vector<char> buffer;
  for (int64_t done = 0; done < length; ++part) {
    const int64_t begin = offset + done - part->start;
    const int64_t count = std::min(part->size - begin, length - done);
    buffer.resize(static_cast<size_t>(count));
    std::ifstream stream(files_[part->file], std::ios::binary);
    stream.seekg(part->file_offset + begin);
    if (!stream.read(buffer.data(), count)) {
      throw std::runtime_error("cannot read " + files_[part->file] + " (changed during the run?)");
    }
    visit_bytes(buffer, done);
    done += count;
  }
}

at::Tensor TextCorpus::read(Split split, int64_t offset, int64_t length) const {
  at::Tensor tokens = at::empty({length}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  visit(split, offset, length, [&](const std::vector<char>& bytes, int64_t at) {
    for (size_t i = 0; i < bytes.size(); ++i) out[at + i] = static_cast<unsigned char>(bytes[i]);
  });
  return tokens;
}

std::array<int64_t, 256> TextCorpus::byte_counts(Split split, int64_t offset,
                                                 int64_t length) const {
  std::array<int64_t, 256> counts{};
  // In pieces, so that a large share is not held at once.
  constexpr int64_t kPiece = 1 << 20;
  for (int64_t at = offset; at < offset + length; at += kPiece) {
    visit(split, at, std::min(kPiece, offset + length - at),
          [&](const std::vector<char>& bytes, int64_t) {
            for (char byte : bytes) ++counts[static_cast<unsigned char>(byte)];
          });
  }
  return counts;
}

}  // namespace hp::trainer
