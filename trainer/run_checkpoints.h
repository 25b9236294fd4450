#pragma once
// The run's checkpoints: sharded ones (--save, --save-every, last words at a preemption)
// with the run's own state (steps taken, every rank's random generator), resuming from
// them or from an --export (--resume), and the whole-tensor --export.

#include <torch/optim/adamw.h>

#include <cstdint>
#include <string>

#include "hyperparallel/async_checkpoint.h"
#include "trainer/job.h"
#include "trainer/model_parts.h"
#include "trainer/train_options.h"

namespace hp::trainer {

// The checkpoint to resume from: --resume's, or (auto) the newest complete one under
// --save; empty for a fresh start.
std::string checkpoint_to_resume(const TrainOptions& o, int64_t rank);

// Loads a sharded checkpoint or an --export into the model (under --pp: this rank's
// stages), the optimizer and the run's random generators; returns the steps already taken
// (the data continue from there).
int64_t resume(const std::string& from, ModelParts& parts, torch::optim::AdamW& optimizer,
               int64_t rank);

// The checkpoint after `step`: in the background with `saver` (null: before returning).
// `last_words`: the signal that preempted the run, kept in the checkpoint as "last_words"
// (0: a regular save; a resumed run treats both alike).
void save(const TrainOptions& o, int64_t step, ModelParts& parts, torch::optim::AdamW& optimizer,
          const Job& job, hp::AsyncCheckpointSaver* saver = nullptr, int last_words = 0);

// --export: rank 0 writes whole tensors into DIR/model.pt and DIR/optim.pt, one at a time.
// Every rank joins the gathers; under --pp, where no rank holds the whole model, the
// stages' sharded checkpoint (the final --save, else one kept in DIR meanwhile) is what
// rank 0 converts.
void export_full(const TrainOptions& o, ModelParts& parts, torch::optim::AdamW& optimizer,
                 const Job& job);

}  // namespace hp::trainer
