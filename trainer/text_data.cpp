#include "trainer/text_data.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "hyperparallel/collectives.h"
#include "trainer/usage_error.h"

namespace hp::trainer {
namespace {

// The loss of predicting every validation byte by the training bytes' frequencies (add-one
// smoothed), in nats: what a model that ignores context reaches. Each rank counts its
// share of both parts.
double unigram_baseline(const TextCorpus& corpus, int64_t rank, int64_t ranks,
                        const hp::Group& all) {
  at::Tensor counts = torch::zeros({2, kByteVocab}, torch::kDouble);
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const int64_t size = corpus.size(split);
    const int64_t begin = size * rank / ranks, end = size * (rank + 1) / ranks;
    const auto share = corpus.byte_counts(split, begin, end - begin);
    for (int64_t byte = 0; byte < kByteVocab; ++byte) {
      counts[split == Split::kTrain ? 0 : 1][byte] = static_cast<double>(share[byte]);
    }
  }
  hp::all_reduce(counts, hp::ReduceOp::kSum, all).wait();
  const at::Tensor probability = (counts[0] + 1) / (counts[0].sum() + kByteVocab);
  return -(counts[1] * probability.log()).sum().item<double>() / counts[1].sum().item<double>();
}

}  // namespace

TextData load_data(const TrainOptions& o, const Job& job) {
  const int64_t data_ranks = job.layout.data_ranks, data_rank = job.layout.data_rank;
  if (o.batch % data_ranks != 0) {
    throw UsageError("--batch " + std::to_string(o.batch) + " is not divisible by the " +
                     std::to_string(data_ranks) + " data-parallel ranks");
  }
  const int64_t batch_per_rank = o.batch / data_ranks;
  TextData data;
  try {
    data.corpus = std::make_shared<TextCorpus>(o.data, o.validation_fraction);
    data.batches.emplace(data.corpus, o.seq, batch_per_rank, data_rank, data_ranks,
                         static_cast<uint64_t>(o.seed));
    data.validation = validation_batches(data.corpus, o.seq, batch_per_rank, o.eval_batches,
                                         data_rank, data_ranks);
  } catch (const std::invalid_argument& error) {
    throw UsageError(std::string("--data: ") + error.what());
  }
  data.unigram = unigram_baseline(*data.corpus, job.rank, job.ranks, job.all());
  return data;
}

}  // namespace hp::trainer
