#pragma once
// Evaluating and sampling the model, whichever way the run holds it (model_parts.h).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hyperparallel/process_group.h"
#include "trainer/text_batches.h"

namespace hp::trainer {

// A batch's mean loss and the bytes it averages; {undefined, 0} on a rank that computes
// none (a pipeline rank without the last stage).
using LossOf = std::function<std::pair<at::Tensor, int64_t>(const Batch&)>;

// The logits [vocab] of the byte after `tokens` [1, T], the same on every rank.
using NextLogits = std::function<at::Tensor(const at::Tensor&)>;

// How the run evaluates and samples its model: whole on every rank, or through the
// pipeline's stages forward only (the last stage's results sent to the others).
struct Evaluation {
  LossOf loss_of;
  NextLogits next_logits;
};

// Mean loss per byte over every rank's validation batches.
double validation_loss(const LossOf& loss_of, const std::vector<Batch>& batches,
                       const hp::Group& all);

// `length` bytes after `prompt`, top-k sampled with a generator seeded alike on every
// rank: the ranks compute the same logits, so they draw the same bytes and run the same
// collectives.
std::string generate(const NextLogits& next_logits, const std::string& prompt, int64_t length,
                     int64_t context, uint64_t seed);

// Text safe for a terminal: other control bytes and stray UTF-8 bytes shown as '?'.
std::string printable(const std::string& text);

}  // namespace hp::trainer
