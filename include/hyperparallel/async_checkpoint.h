#pragma once
// Sharded checkpoints saved in the background: save() takes a snapshot of this rank's
// pieces and returns; a thread of the saver writes them and commits the directory (the
// protocol of save_sharded_checkpoint: atomic, every rank learns of a failure) while
// training goes on. Ranks agree over a group of their own, made at the first save, so the
// writer never orders its collectives against the training's.
//
//   hp::AsyncCheckpointSaver saver;
//   for (int64_t step = 1; step <= steps; ++step) {
//     train_step();
//     if (step % every == 0) saver.save(hp::checkpoint_dir_for_step(root, step), model, &optim);
//   }
//   saver.wait();  // before exit: the last save is on disk, or every rank throws
//
// One save is in flight at a time: save() first waits for the one before (and throws its
// failure).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>

#include "hyperparallel/state_dict.h"

namespace hp {

namespace detail {
class AsyncCheckpointWriter;
}

// How save() takes its snapshot (docs/performance.md, "Checkpoint saves", measures both).
enum class CheckpointStaging {
  // Copies the pieces into host staging memory (pinned for GPU tensors), kept and reused
  // by the next save when the shapes match. save() blocks for the copy.
  kCopy,
  // Pieces on the CPU: the process forks a writer, whose copy-on-write view of memory is
  // the snapshot. save() blocks only for the fork, but while the write runs the kernel
  // copies every page training writes to (its activations and gradients too, not only
  // the pieces), so the steps during the write pay more than kCopy's copy where cores are
  // few. Pieces on a GPU: as kCopy.
  kFork,
};

class AsyncCheckpointSaver {
 public:
  explicit AsyncCheckpointSaver(CheckpointStaging staging = CheckpointStaging::kCopy);
  // Waits for the save in flight; a failure it had is reported with TORCH_WARN (call wait()
  // to have it thrown).
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Starts saving what save_sharded_checkpoint would save into `dir` and returns once this
  // rank's pieces are staged: the model and optimizer may change right after. A collective
  // over the model's fully_shard mesh like save_sharded_checkpoint (call it on every rank
  // between steps); waits for the previous save first, throwing as wait() does.
  void save(const std::string& dir, torch::nn::Module& model,
            torch::optim::Optimizer* optimizer = nullptr, const StateDict& extra = StateDict());

  // Waits until the save in flight is complete on disk on every rank (none: returns at
  // once). When it failed on any rank, every rank throws c10::Error naming the ranks
  // (each adds its own reason) and the directory is left as it was before the save.
  void wait();

  // Whether a save is still being written.
  bool busy() const;

 private:
  std::unique_ptr<detail::AsyncCheckpointWriter> writer_;
};

}  // namespace hp
