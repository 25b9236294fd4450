#include "trainer/text_batches.h"

#include <stdexcept>
#include <string>

namespace hp::trainer {

TextWindows::TextWindows(std::shared_ptr<const TextCorpus> corpus, Split split, int64_t seq)
    : corpus_(std::move(corpus)), split_(split), seq_(seq) {}

Batch TextWindows::get(size_t index) {
  const at::Tensor bytes = corpus_->read(split_, static_cast<int64_t>(index) * seq_, seq_ + 1);
  return {bytes.narrow(0, 0, seq_), bytes.narrow(0, 1, seq_)};
}

std::optional<size_t> TextWindows::size() const {
  return static_cast<size_t>((corpus_->size(split_) - 1) / seq_);
}

namespace {

Batch stack(std::vector<Batch> examples) {
  return torch::data::transforms::Stack<>().apply_batch(std::move(examples));
}

std::string split_name(Split split) { return split == Split::kTrain ? "training" : "validation"; }

void require_windows(int64_t available, int64_t needed, Split split, int64_t seq) {
  if (available < needed) {
    throw std::invalid_argument("the " + split_name(split) + " text holds " +
                                std::to_string(available) + " sequences of " +
                                std::to_string(seq + 1) + " bytes, " + std::to_string(needed) +
                                " needed: give more text, a shorter sequence or a smaller batch");
  }
}

}  // namespace

TrainBatches::TrainBatches(std::shared_ptr<const TextCorpus> corpus, int64_t seq,
                           int64_t batch_per_rank, int64_t rank, int64_t ranks, uint64_t seed)
    : windows_(std::move(corpus), Split::kTrain, seq),
      // No duplicates: the ranks' shares are disjoint; the few windows beyond a multiple
      // of the rank count are left out.
      sampler_(*windows_.size(), static_cast<size_t>(ranks), static_cast<size_t>(rank),
               /*allow_duplicates=*/false),
      batch_per_rank_(batch_per_rank),
      seed_(seed) {
  const auto windows = static_cast<int64_t>(*windows_.size());
  require_windows(windows, batch_per_rank * ranks, Split::kTrain, seq);
  steps_per_epoch_ = windows / ranks / batch_per_rank;
}

Batch TrainBatches::at_step(int64_t step) {
  const int64_t epoch = (step - 1) / steps_per_epoch_;
  const int64_t in_epoch = (step - 1) % steps_per_epoch_;
  // The sampler shuffles with std::mt19937 seeded by its epoch: make that (seed, epoch).
  sampler_.set_epoch(seed_ * 1'000'003 + static_cast<uint64_t>(epoch));
  sampler_.reset();
  if (in_epoch > 0) sampler_.next(static_cast<size_t>(in_epoch * batch_per_rank_));
  const std::vector<size_t> indices = *sampler_.next(static_cast<size_t>(batch_per_rank_));
  return stack(windows_.get_batch(indices));
}

std::vector<Batch> validation_batches(std::shared_ptr<const TextCorpus> corpus, int64_t seq,
                                      int64_t batch_per_rank, int64_t batches, int64_t rank,
                                      int64_t ranks) {
  TextWindows windows(std::move(corpus), Split::kValidation, seq);
  const auto available = static_cast<int64_t>(*windows.size());
  require_windows(available, ranks, Split::kValidation, seq);
  const int64_t mine = std::min(batches * batch_per_rank, available / ranks);
  std::vector<Batch> result;
  for (int64_t first = 0; first < mine; first += batch_per_rank) {
    std::vector<size_t> indices;
    for (int64_t i = first; i < std::min(mine, first + batch_per_rank); ++i) {
      indices.push_back(static_cast<size_t>(i * ranks + rank));
    }
    result.push_back(stack(windows.get_batch(indices)));
  }
  return result;
}

}  // namespace hp::trainer
