#pragma once
// Checkpoints of fully_shard-ed models. A full state dict holds whole tensors named as in
// the unsharded model (what named_parameters() and named_buffers() of the model on one
// process give), so a checkpoint does not depend on the mesh it was saved from: save on
// 4 ranks as 2x2 HSDP, load on 3 ranks as FSDP or into the plain model on one process.
//
// Checkpoint files are in torch.save's format: Python's torch.load reads them (also with
// weights_only=True), and load_full_checkpoint reads a state dict Python's torch.save
// wrote.

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
// own part, without communication. Throws std::invalid_argument naming the first entry
// that is missing, has another shape, or (strict) is not in the model. Between steps.
void set_full_state_dict(torch::nn::Module& model, const StateDict& state, bool strict = true);

// The optimizer's per-parameter state as whole tensors, named after the parameter:
// "<name>.step", "<name>.exp_avg", "<name>.exp_avg_sq" (and "<name>.max_exp_avg_sq"
// with amsgrad) for torch::optim::Adam and AdamW, "<name>.momentum_buffer" for SGD.
// Parameters without state (no step yet) have no entries. Hyperparameters (lr, betas,
// ...) belong to the program, not to the checkpoint. A collective like
// get_full_state_dict; other optimizers are refused (std::invalid_argument).
StateDict get_full_optimizer_state_dict(torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer);

// Replaces the optimizer's per-parameter state with each rank's part of the whole
// tensors (no communication). Throws std::invalid_argument naming an entry that has
// another shape or, strict, belongs to no parameter; the optimizer is unchanged then.
void set_full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDict& state, bool strict = true);

// A state dict as a file in torch.save's format, and back.
void write_state_dict_file(const StateDict& state, const std::string& path);
StateDict read_state_dict_file(const std::string& path);

// get_full_state_dict, written to `path` by rank 0 of the launch (RANK; a process
// without RANK writes). A collective like get_full_state_dict. The other ranks do not
// wait for the file: put a barrier before reading it elsewhere.
void save_full_checkpoint(torch::nn::Module& model, const std::string& path);

// Reads `path` on every rank (a shared or copied file) and set_full_state_dict's it.
void load_full_checkpoint(torch::nn::Module& model, const std::string& path, bool strict = true);

}  // namespace hp
