#pragma once
// Checkpoints of fully_shard-ed models. A full state dict holds whole tensors named as in
// the unsharded model (what named_parameters() and named_buffers() of the model on one
// process give), so a checkpoint does not depend on the mesh it was saved from: save on
// 4 ranks as 2x2 HSDP, load on 3 ranks as FSDP or into the plain model on one process.
//
// Checkpoint files are in torch.save's format: Python's torch.load reads them (also with
// weights_only=True), and load_full_checkpoint reads a dict of tensors Python's
// torch.save wrote (save a state dict as torch.save(dict(model.state_dict()), path):
// LibTorch's unpickler cannot read the OrderedDict state_dict() returns).
//
// The checkpoint functions stream: saving gathers one whole tensor at a time, which the
// writing rank appends to the file and every rank drops before the next; loading reads
// one tensor at a time and keeps only each rank's part. No rank holds the whole model or
// the whole optimizer state. Peak host memory above what the model holds: a few times the
// largest tensor while saving (gather buffers and the whole tensor cut from them), one
// tensor while loading (docs/api.md has the numbers).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <string>

namespace hp {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// Every parameter and buffer of `model`, whole, on the host, in the model's order.
// Sharded parameters are all-gathered over their shard groups: a collective that every
// rank calls with its model, between steps (not between a forward and its backward).
StateDict get_full_state_dict(torch::nn::Module& model);

// Sets every parameter and buffer of `model` from whole tensors: each rank copies its
// own part, without communication. Throws c10::ValueError naming the first entry
// that is missing, has another shape, or (strict) is not in the model. Between steps.
void set_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict = true);

// The optimizer's per-parameter state as whole tensors, named after the parameter:
// "<name>.step", "<name>.exp_avg", "<name>.exp_avg_sq" (and "<name>.max_exp_avg_sq"
// with amsgrad) for torch::optim::Adam and AdamW, "<name>.momentum_buffer" for SGD.
// Parameters without state (no step yet) have no entries. Hyperparameters (lr, betas,
// ...) belong to the program, not to the checkpoint. A collective like
// get_full_state_dict; other optimizers are refused (c10::ValueError).
StateDict get_full_optimizer_state_dict(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer);

// Replaces the optimizer's per-parameter state with each rank's part of the whole
// tensors (no communication). Throws c10::ValueError naming an entry that has
// another shape or, strict, belongs to no parameter; the optimizer is unchanged then.
void set_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDict& state, bool strict = true);

// A state dict as a file in torch.save's format, and back (no collective). Both stream
// through the file one tensor at a time; read_state_dict_file returns them all, each
// holding its own storage (entries that share one in the file, e.g. tied weights Python
// saved, come back as separate copies). write_state_dict_file writes "<path>.partial" and
// renames it to `path` when complete, as the checkpoint functions do. Errors name the
// file and the tensor: c10::ValueError for a file that cannot be opened or is not
// a torch.save dict of dense tensors, c10::Error for a failed write or read.
void write_state_dict_file(const StateDict& state, const std::string& path);
StateDict read_state_dict_file(const std::string& path);

// get_full_state_dict streamed into `path` by rank 0 of the launch (RANK; a process
// without RANK writes): a collective like get_full_state_dict, one whole tensor at a time.
// The file appears at `path` only when complete. A write error is thrown on the writing
// rank (c10::Error naming the file and the tensor) after the remaining gathers,
// so that the other ranks are not left waiting; they do not learn of it. The other ranks
// do not wait for the file: put a barrier before reading it elsewhere.
void save_full_checkpoint(torch::nn::Module& model, const std::string& path);

// Reads `path` on every rank (a shared or copied file) one tensor at a time and copies
// each rank's part, as set_full_state_dict does. Names and shapes are checked against
// the model before any tensor is read, with set_full_state_dict's errors naming the file;
// the model is unchanged then. A record that cannot be read (a damaged file) throws
// c10::Error saying the model is partly loaded.
void load_full_checkpoint(torch::nn::Module& model, const std::string& path, bool strict = true);

// get_full_optimizer_state_dict streamed into `path` like save_full_checkpoint.
void save_full_optimizer_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const std::string& path);

// set_full_optimizer_state_dict from `path`, streamed like load_full_checkpoint.
void load_full_optimizer_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const std::string& path, bool strict = true);

}  // namespace hp
