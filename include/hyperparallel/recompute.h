#pragma once
// Activation recomputation: run part of a forward without keeping its activations and
// recompute them when backward needs them. One extra forward of the region buys the
// memory of its activations.
//
//   h = hp::recompute([&](const at::Tensor& x) { return block(x); }, h);
//
// Composes with fully_shard in both orders. A recomputed region may contain
// fully_shard-ed modules: their recompute runs on the parameters backward gathered and
// changes neither the prefetch order nor the gradient reductions. A fully_shard-ed
// module may recompute parts of its own forward.
//
// The region must compute the same thing when run again: the same inputs, parameters
// unchanged between forward and backward, random draws reproduced (preserve_rng_state).

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

namespace hp {

enum class RecomputeImpl {
  // Saved-tensor hooks (PyTorch's use_reentrant=False). Forward runs with autograd and
  // builds the graph, but keeps none of the tensors the graph saves. The first backward
  // node that needs one reruns the region and takes the tensors from the rerun.
  // Gradients flow through the original graph, so torch::autograd::grad, gradient hooks
  // and regions whose inputs need no gradient all work.
  kNonReentrant,
  // An autograd function (PyTorch's use_reentrant=True). Forward runs without autograd;
  // the function's backward reruns the region with autograd and backpropagates through
  // the rerun (a nested backward). Needs an input that requires grad, and works with
  // backward() only, not with torch::autograd::grad.
  kReentrant,
};

struct RecomputeOptions {
  RecomputeImpl impl = RecomputeImpl::kNonReentrant;
  // Put the random generators (CPU, and the devices of the inputs) back to their
  // forward-time state for the rerun, so that dropout draws the same masks. false: the
  // rerun draws on from where the generators are (other masks), advancing them by what it
  // drew, which early stop makes less than a whole rerun.
  bool preserve_rng_state = true;
  // Early stop (non-reentrant only; unset means on for it): the rerun ends as soon as it
  // has saved every tensor the forward saved, so what follows the last saved tensor does
  // not run again. An operation saves its inputs before it computes, so a region ending
  // in a linear layer skips that layer's matmul. The rerun is left by an exception that
  // recompute catches: code in the region must let exceptions it does not know pass
  // (a catch (...) that swallows them is reported), and side effects after the last saved
  // tensor happen in forward only. false reruns the whole region. A reentrant rerun is
  // backpropagated through, so it always runs whole: true with kReentrant is refused.
  std::optional<bool> early_stop;
};

using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) as a recomputed region and returns its outputs. fn is kept (by
// value) until backward has recomputed the region, so what it refers to must live that
// long. Without autograd (no-grad mode) this is just fn(inputs).
std::vector<at::Tensor> recompute(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs,
                                  const RecomputeOptions& options = {});

// The one-tensor form.
at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input, const RecomputeOptions& options = {});

}  // namespace hp
