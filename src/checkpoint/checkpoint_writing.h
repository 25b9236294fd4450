#pragma once
// Writing a sharded checkpoint, shared by the synchronous save and the background one:
// what each rank writes, and the protocol that makes the directory appear complete on
// every rank or not at all.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../materialize/model_params.h"
#include "hyperparallel/process_group.h"
#include "hyperparallel/state_dict.h"

namespace hp::detail {

// Where each tensor a rank writes lies in its whole tensor.
struct RankPiece {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> offsets;
  std::vector<int64_t> whole_shape;
};

// What this rank saves of `model`, `optimizer` and `extra`: one copy of every shard (HSDP
// replicas: replicate rank 0), each tensor kept whole once (by the lowest World rank
// holding it: rank 0 unless pipeline stages hold their own), `extra` on rank 0, and its own
// error-feedback residuals; the tensors the live ones (detached); and the World the save
// is a collective over (null: this process alone). Checks first, before any collective,
// that every fully_shard-ed parameter is sharded (errors name `caller`), so that all ranks
// throw or none does.
struct RankSave {
  std::shared_ptr<World> world;
  std::vector<RankPiece> pieces;
};
RankSave rank_save(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                   const StateDict& extra, const std::string& caller);

// The World of the model's fully_shard-ed parameters; null when it has none (the calling
// process saves and loads alone). Throws c10::ValueError naming `caller` for a model with
// parallel slices but no fully_shard.
std::shared_ptr<World> world_of(const std::vector<ModelParam>& params, const std::string& caller);

// Runs `step` on this rank and agrees with the other ranks of `group` (null: alone) on the
// outcome (an all-gather, which also makes it a barrier): returns when it succeeded
// everywhere. Otherwise every rank throws: a rank that failed its own error, the others
// c10::Error naming the ranks that failed.
void on_every_rank(const Group* group, const std::string& caller, const std::string& what,
                   const std::function<void()>& step);

// A checkpoint is written into "<dir>.partial" and renamed to `dir` once complete.
inline constexpr const char* kStagedSuffix = ".partial";

// Writes `pieces` into the safetensors file `path` (flushed to the disk), with the piece
// records this library reads and the DCP_SHARDING_INFO PyTorch reads.
void write_rank_file(const std::string& path, const std::vector<RankPiece>& pieces);

// Where this rank's file of the checkpoint `dir` is written (group rank r writes
// rank-<r>.safetensors into the staged directory).
std::string staged_rank_file(const std::string& dir, const Group* group);

// The atomic protocol of save_sharded_checkpoint, a collective over `group`: group rank 0
// makes the staged directory, then every rank writes its file there with
// `write_this_rank(path)`, and group rank 0 commits the directory once every file is
// complete.
void write_checkpoint(const std::string& dir,
                      const std::function<void(const std::string&)>& write_this_rank,
                      const Group* group, const std::string& caller);

}  // namespace hp::detail
