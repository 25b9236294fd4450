#pragma once
// Language-modeling batches from a TextCorpus, with LibTorch's data utilities: a Dataset
// of fixed-length windows, a DistributedRandomSampler that deals each epoch's shuffled
// windows out to the data-parallel ranks (disjoint shares), and the Stack collation.

#include <torch/data.h>

#include <memory>
#include <vector>

#include "trainer/text_corpus.h"

namespace hp::trainer {

using Batch = torch::data::Example<>;  // data: input [b, seq]; target: input shifted by one

// Window i of a split: bytes [i * seq, i * seq + seq + 1), as input and next-byte target.
class TextWindows : public torch::data::datasets::Dataset<TextWindows> {
 public:
  TextWindows(std::shared_ptr<const TextCorpus> corpus, Split split, int64_t seq);
  Batch get(size_t index) override;
  std::optional<size_t> size() const override;

 private:
  std::shared_ptr<const TextCorpus> corpus_;
  Split split_;
  int64_t seq_;
};

// One rank's training batches. The batch of a step depends only on (seed, step, rank,
// ranks): a resumed run sees the batches an uninterrupted one would.
class TrainBatches {
 public:
  // Throws std::invalid_argument when the training split holds less than one batch per rank.
  TrainBatches(std::shared_ptr<const TextCorpus> corpus, int64_t seq, int64_t batch_per_rank,
               int64_t rank, int64_t ranks, uint64_t seed);
  Batch at_step(int64_t step);  // steps count from 1
  int64_t steps_per_epoch() const { return steps_per_epoch_; }

 private:
  TextWindows windows_;
  torch::data::samplers::DistributedRandomSampler sampler_;
  int64_t batch_per_rank_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
};

// This rank's validation batches: the first windows of the validation split dealt out
// round-robin, at most `batches` of them (the same every evaluation). Throws
// std::invalid_argument when the split has no window for some rank.
std::vector<Batch> validation_batches(std::shared_ptr<const TextCorpus> corpus, int64_t seq,
                                      int64_t batch_per_rank, int64_t batches, int64_t rank,
                                      int64_t ranks);

}  // namespace hp::trainer
