#include "hyperparallel/clip_grad.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <string>

#include "hyperparallel/collectives.h"
#include "hyperparallel/parallel_slice.h"
#include "hyperparallel/sharded_parameter.h"

namespace hp {
namespace {

// One parameter's gradient as this rank holds it. `shard_group`: the ranks holding the
// other shards of it; null when this rank holds all of it. `slice_group`: the
// ranks holding its other parallel slices; null when it is not a slice (then it is
// counted once, as every rank of a slice's group holds the same).
struct GradPart {
  at::Tensor grad;  // undefined: no gradient (the rank still joins its groups' sums)
  const Group* shard_group = nullptr;
  const Group* slice_group = nullptr;
};

std::vector<GradPart> grad_parts(const std::vector<at::Tensor>& parameters) {
  std::vector<GradPart> parts;
  for (const at::Tensor& param : parameters) {
    GradPart part;
    if (auto sharded = sharded_parameter_of(param)) {
      part = {sharded->local_grad(), &sharded->shard_group()};
    } else if (param.grad().defined()) {
      part.grad = param.grad();
    } else {
      continue;
    }
    if (auto slice = parallel_slice_of(param)) {
      part.slice_group = slice->group.get();
    }
    parts.push_back(part);
  }
  return parts;
}

// The norm's partial result over `grads`: the max of |g| for the infinity norm, the sum
// of |g|^p otherwise; in double, on the gradients' device.
at::Tensor partial_norm(const std::vector<at::Tensor>& grads, double norm_type,
                        const at::TensorOptions& options) {
  const bool max_norm = std::isinf(norm_type);
  at::Tensor result = at::zeros({}, options);
  for (const at::Tensor& grad : grads) {
    // .to(): offloaded shards live on the host while other gradients may not.
    at::Tensor norm =
        at::linalg_vector_norm(grad, norm_type, {}, false, at::kDouble).to(result.device());
    result = max_norm ? at::maximum(result, norm) : result + norm.pow(norm_type);
  }
  return result;
}

// The p-th power of the global norm (the norm itself for the max norm), on the gradients'
// device; `parts` their gradients.
at::Tensor global_norm_power(const std::vector<GradPart>& parts, double max_norm,
                             double norm_type) {
  if (!(max_norm > 0)) {
    C10_THROW_ERROR(ValueError,
                    "clip_grad_norm_: max_norm must be positive, got " + std::to_string(max_norm));
  }
  if (!(norm_type > 0)) {
    C10_THROW_ERROR(
        ValueError,
        "clip_grad_norm_: norm_type must be positive (or infinity for the max norm), got " +
            std::to_string(norm_type));
  }
  const bool max_norm_type = std::isinf(norm_type);
  at::TensorOptions options = at::TensorOptions().dtype(at::kDouble);
  for (const GradPart& part : parts) {
    if (part.grad.defined()) {
      options = options.device(part.grad.device());
      break;
    }
  }

  // Whole gradients count as they are; shards and slices are combined over their groups
  // first, one collective per group, in the order the groups first appear (the same on
  // all ranks).
  using Groups = std::pair<const Group*, const Group*>;  // shard, slice
  std::vector<at::Tensor> whole;
  std::vector<Groups> order;
  std::map<Groups, std::vector<at::Tensor>> split;
  for (const GradPart& part : parts) {
    if (!part.shard_group && !part.slice_group) {
      whole.push_back(part.grad);
      continue;
    }
    const Groups groups{part.shard_group, part.slice_group};
    if (!split.count(groups)) order.push_back(groups);
    // The entry exists even without gradients: this rank still joins the groups' sums.
    std::vector<at::Tensor>& grads = split[groups];
    if (part.grad.defined()) grads.push_back(part.grad);
  }
  at::Tensor total = partial_norm(whole, norm_type, options);
  const ReduceOp combine = max_norm_type ? ReduceOp::kMax : ReduceOp::kSum;
  for (const Groups& groups : order) {
    at::Tensor partial = partial_norm(split[groups], norm_type, options);
    for (const Group* group : {groups.first, groups.second}) {
      if (group) all_reduce(partial, combine, *group).wait();
    }
    total = max_norm_type ? at::maximum(total, partial) : total + partial;
  }
  return total;
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  c10::NoGradGuard no_grad;
  const std::vector<GradPart> parts = grad_parts(parameters);
  const at::Tensor total = global_norm_power(parts, max_norm, norm_type);
  const double norm = std::isinf(norm_type) ? total.item<double>()
                                            : std::pow(total.item<double>(), 1.0 / norm_type);

  if (error_if_nonfinite && !std::isfinite(norm)) {
    C10_THROW_ERROR(Error, "clip_grad_norm_: the total norm of the gradients is " +
                               std::to_string(norm) +
                               ", so they cannot be clipped; pass error_if_nonfinite = false "
                               "to scale them by it anyway");
  }
  // As PyTorch: a NaN norm makes every gradient NaN, an infinite one zeroes them.
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0 || std::isnan(scale)) {
    for (const GradPart& part : parts) {
      if (part.grad.defined()) part.grad.mul_(scale);
    }
  }
  return norm;
}

at::Tensor clip_grad_norm_on_device_(const std::vector<at::Tensor>& parameters, double max_norm,
                                     double norm_type) {
  c10::NoGradGuard no_grad;
  const std::vector<GradPart> parts = grad_parts(parameters);
  const at::Tensor total = global_norm_power(parts, max_norm, norm_type);
  const at::Tensor norm = std::isinf(norm_type) ? total : total.pow(1.0 / norm_type);
  // min(1, scale) keeps NaN (every gradient NaN) and makes an infinite norm zero them.
  const at::Tensor scale = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  for (const GradPart& part : parts) {
    if (part.grad.defined()) part.grad.mul_(scale.to(part.grad.device()));
  }
  return norm;
}

}  // namespace hp
