#pragma once
// The run's data: this rank's share of the training batches and of the validation batches,
// and the loss a model has to beat.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "trainer/job.h"
#include "trainer/text_batches.h"
#include "trainer/text_corpus.h"
#include "trainer/train_options.h"

namespace hp::trainer {

constexpr int64_t kByteVocab = 256;  // the byte-level model's vocabulary

struct TextData {
  std::shared_ptr<const TextCorpus> corpus;
  std::optional<TrainBatches> batches;  // this rank's share of each step
  std::vector<Batch> validation;        // this rank's share
  double unigram = 0;                   // the loss a model has to beat: each byte by its frequency
};

// Reads --data and deals its batches; throws UsageError for a batch the data-parallel ranks
// cannot divide, or data that is not there.
TextData load_data(const TrainOptions& o, const Job& job);

}  // namespace hp::trainer
