#pragma once
// Sharded checkpoints: every rank writes only the shards it holds, in parallel, and no
// rank ever holds the whole model or optimizer state (torch.distributed.checkpoint's idea).
// A checkpoint is a directory:
//
//   index.json              every tensor's dtype, whole shape and pieces (file, offsets
//                           into the whole tensor, shape, CRC-32 of its bytes)
//   rank-00000.safetensors  the pieces rank 0 wrote, one per tensor (safetensors format)
//   rank-00001.safetensors  ...
//   COMPLETE                written last, with the CRC-32 of index.json: a directory
//                           without it is never loaded, nor an index that does not match
//
// Parameters and buffers are named by their fully qualified names ("layers.0.attn.wq.weight",
// as PyTorch names them), optimizer state "optim/<parameter name>.<field>" (the names of
// get_full_optimizer_state_dict), extras "extra/<name>" and, with CommPolicy::error_feedback,
// each rank's residuals "error_feedback/<parameter name>" (a row per rank). HSDP replicas write one
// copy of each shard (replicate rank 0); parameters kept whole (replicated, ignored) and buffers
// once, by the lowest rank holding each (rank 0, unless a pipeline stage holds its own).
//
// PyTorch reads it with its Distributed Checkpoint: each file's header carries the
// DCP_SHARDING_INFO that torch.distributed.checkpoint.HuggingFaceStorageReader reads, so
//
//   dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(dir))
//
// loads the model part into a plain PyTorch model or an FSDP2-sharded one of any size
// (docs/checkpoints.md). tools/sharded_checkpoint.py also checks the CRCs, which DCP does
// not, and converts a checkpoint to whole tensors or a torch.save file.
//
// Saving is atomic: the files go to "<dir>.partial", are flushed to the disk, and the
// directory is renamed to `dir` once every rank's file is complete; a crash at any point
// leaves `dir` as it was (or, when replacing an existing `dir`, no `dir` at all) and never
// a mixed checkpoint. Loading works on any mesh and world size: each rank reads only the
// pieces that overlap its shards (whole pieces, so that their checksums are verified).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <optional>
#include <string>
#include <vector>

#include "hyperparallel/state_dict.h"

namespace hp {

// Writes `model`'s parameters and buffers, `optimizer`'s per-parameter state (Adam,
// AdamW, SGD; none when null) and `extra` (small tensors the program keeps with the
// checkpoint, e.g. its step, data position and RNG state; whole, written by rank 0) into
// the directory `dir`, replacing a checkpoint already there. A collective over every rank
// of the World of the model's fully_shard mesh (a model without fully_shard is saved by
// the calling process alone); call it on every rank between steps. A model split over the
// ranks (pipeline stages) is saved by each rank passing a module of the part it holds,
// named as in the whole model ("layers.5..."): the checkpoint is then the whole model's,
// loadable with or without stages. A parameter two stages hold alike (a tied embedding's
// copy) is passed by one of them. It returns once the checkpoint is
// complete on disk, on every rank; when any rank fails to write, every rank throws
// c10::Error naming the ranks that failed (each adds its own reason) and nothing
// is saved.
void save_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer = nullptr,
                             const StateDict& extra = StateDict());

// Loads a checkpoint save_sharded_checkpoint wrote (on any mesh or world size) into
// `model` and, when not null, `optimizer`, and returns its extra tensors. It also loads the
// model from a directory PyTorch's HuggingFaceStorageWriter wrote (sharded, e.g. from an
// FSDP2 model, or consolidated whole tensors), by the model's fully qualified names; those
// hold no optimizer state nor extras, and no CRCs to check. Names and
// shapes are checked before any tensor is read (c10::ValueError naming the
// checkpoint and the entry; strict: every model and optimizer entry must be used by
// some rank, as each pipeline stage loads only the part it holds). Every
// piece read is checked against its CRC-32: a damaged one throws c10::Error
// naming the file and the tensor. A collective like the save: when any rank fails, every
// rank throws. Call it between steps, after fully_shard (also on a deferred model,
// instead of materialize()).
StateDict load_sharded_checkpoint(const std::string& dir, torch::nn::Module& model,
                                  torch::optim::Optimizer* optimizer = nullptr, bool strict = true);

// Writes the whole tensors of the checkpoint in `dir` (one save_sharded_checkpoint wrote, or
// one PyTorch's HuggingFaceStorageWriter wrote) into torch.save files, in the calling
// process alone and one tensor at a time: the model's parameters and buffers into
// `model_path`, as save_full_checkpoint writes them, and, unless `optimizer_path` is empty,
// the optimizer's state into it, as save_full_optimizer_checkpoint writes it. Entries are
// in name order; load_full_checkpoint (on any mesh) and Python's torch.load read both. No
// model is needed, so it also consolidates a checkpoint of pipeline stages. Pieces are
// checked as load_sharded_checkpoint checks them; each file appears only when complete.
// Throws c10::ValueError, before writing anything, when `optimizer_path` is given and the
// checkpoint holds no optimizer state, or names the file `model_path` names.
void convert_to_full_checkpoint(const std::string& dir, const std::string& model_path,
                                const std::string& optimizer_path = "");

// Whether `dir` holds a complete sharded checkpoint (its COMPLETE marker is there).
bool is_complete_checkpoint(const std::string& dir);

// The complete checkpoint under `root` with the highest step, for resuming: among the
// subdirectories named "step-<N>" (as checkpoint_dir_for_step makes them) that are
// complete and intact: its index (its CRC-32 and its pieces covering every tensor once) and
// every file the index names, present and holding its pieces within its size (headers
// read, so a missing or truncated rank file is found). `check_data` also reads every
// piece and checks its CRC-32 (the whole checkpoint read); otherwise the pieces' CRCs are
// checked as they load. Newer complete ones that are damaged are passed over, each with
// the reason appended to `skipped` when given. Unset when there is none (or no `root`).
std::optional<std::string> latest_checkpoint(const std::string& root,
                                             std::vector<std::string>* skipped = nullptr,
                                             bool check_data = false);

// "<root>/step-<step>", the step zero-padded to 8 digits so that names sort by step.
std::string checkpoint_dir_for_step(const std::string& root, int64_t step);

}  // namespace hp
