#include "hyperparallel/tensor_parallel.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>

#include "hyperparallel/collectives.h"

namespace hp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool is_parallel(const GroupPtr& group) { return group && group->size() > 1; }
int64_t size_of(const GroupPtr& group) { return group ? group->size() : 1; }
int64_t rank_of(const GroupPtr& group) { return group ? group->rank() : 0; }

// The whole weight [out, in] and bias [out] (undefined without one), drawn as
// torch::nn::Linear draws them.
std::pair<at::Tensor, at::Tensor> linear_parameters(int64_t in, int64_t out, bool with_bias) {
  at::Tensor weight = torch::empty({out, in});
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  at::Tensor bias;
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    bias = torch::empty({out});
    torch::nn::init::uniform_(bias, -bound, bound);
  }
  return {weight, bias};
}

// Registers on `module` this rank's slice along `dim` of `whole` (built alike on every
// rank) as parameter `name`, declared a parallel slice; `whole` itself without a group.
at::Tensor register_slice(torch::nn::Module& module, const std::string& name,
                          const at::Tensor& whole, int64_t dim, const GroupPtr& group) {
  if (!is_parallel(group)) return module.register_parameter(name, whole);
  const ParallelSlice slice{group, dim};
  at::Tensor param = module.register_parameter(name, slice_of(whole, slice).clone());
  declare_parallel_slice(param, slice);
  return param;
}

void require_divisible(const char* layer, const char* what, int64_t value, const GroupPtr& group) {
  if (value % size_of(group) != 0) {
    C10_THROW_ERROR(ValueError, std::string(layer) + ": " + what + " (" + std::to_string(value) +
                                    ") must be divisible by the tensor-parallel group size (" +
                                    std::to_string(size_of(group)) +
                                    "); choose sizes that split evenly over the group");
  }
}

// Carries the group through the autograd context.
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(GroupPtr g) : group(std::move(g)) {}
  GroupPtr group;
};

void save_group(AutogradContext* ctx, const GroupPtr& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupRef>(group));
}
const Group& saved_group(AutogradContext* ctx) {
  return *static_cast<GroupRef*>(ctx->saved_data["group"].toCapsule().get())->group;
}

at::Tensor summed(const at::Tensor& x, const Group& group) {
  at::Tensor sum = x.clone(at::MemoryFormat::Contiguous);
  all_reduce(sum, ReduceOp::kSum, group).wait();
  return sum;
}

// The ranks' x put side by side along the last dim.
at::Tensor gathered_last_dim(const at::Tensor& x, const Group& group) {
  at::Tensor local = x.contiguous();
  std::vector<int64_t> stacked_shape{group.size()};
  stacked_shape.insert(stacked_shape.end(), local.sizes().begin(), local.sizes().end());
  at::Tensor stacked = at::empty(stacked_shape, local.options());
  all_gather(stacked, local, group).wait();
  return at::cat(stacked.unbind(0), -1);
}

at::Tensor own_slice_last_dim(const at::Tensor& x, const Group& group) {
  return x.chunk(group.size(), -1)[group.rank()].contiguous();
}

at::Tensor unchanged(const at::Tensor& x, const Group&) { return x.view_as(x); }

// An autograd function that lays x out by `Forward` and its gradient by `Backward` over
// the group (Megatron-LM's conjugate pairs).
template <at::Tensor (*Forward)(const at::Tensor&, const Group&),
          at::Tensor (*Backward)(const at::Tensor&, const Group&)>
struct Conjugate : torch::autograd::Function<Conjugate<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, GroupPtr group) {
    save_group(ctx, group);
    return Forward(x, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], saved_group(ctx)), at::Tensor()};
  }
};

using CopyToTensorParallel = Conjugate<unchanged, summed>;
using ReduceFromTensorParallel = Conjugate<summed, unchanged>;
using GatherFromTensorParallel = Conjugate<gathered_last_dim, own_slice_last_dim>;
// Forward this rank's slice of a replicated x, backward the slices' gradients put together.
using ScatterToTensorParallel = Conjugate<own_slice_last_dim, gathered_last_dim>;

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const GroupPtr& group) {
  return is_parallel(group) ? CopyToTensorParallel::apply(x, group) : x;
}

at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const GroupPtr& group) {
  return is_parallel(group) ? ReduceFromTensorParallel::apply(x, group) : x;
}

at::Tensor gather_from_tensor_parallel(const at::Tensor& x, const GroupPtr& group) {
  return is_parallel(group) ? GatherFromTensorParallel::apply(x, group) : x;
}

ParallelLinearImpl::ParallelLinearImpl(const char* layer_name, int64_t in_features,
                                       int64_t out_features, bool with_bias, int64_t split_dim,
                                       GroupPtr group)
    : group(std::move(group)) {
  if (split_dim == 0) {
    require_divisible(layer_name, "out_features", out_features, this->group);
  } else {
    require_divisible(layer_name, "in_features", in_features, this->group);
  }
  torch::NoGradGuard no_grad;
  const auto [whole_weight, whole_bias] = linear_parameters(in_features, out_features, with_bias);
  weight = register_slice(*this, "weight", whole_weight, split_dim, this->group);
  if (!with_bias) return;
  bias = split_dim == 0 ? register_slice(*this, "bias", whole_bias, 0, this->group)
                        : register_parameter("bias", whole_bias);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                                                   GroupPtr group)
    : ParallelLinearImpl("ColumnParallelLinear", options.in_features, options.out_features,
                         options.bias, /*split_dim=*/0, std::move(group)),
      options(options) {}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor local = torch::linear(copy_to_tensor_parallel(x, group), weight, bias);
  return options.gather_output ? gather_from_tensor_parallel(local, group) : local;
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options, GroupPtr group)
    : ParallelLinearImpl("RowParallelLinear", options.in_features, options.out_features,
                         options.bias, /*split_dim=*/1, std::move(group)),
      options(options) {}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  if (!is_parallel(group)) return torch::linear(x, weight, bias);
  at::Tensor local_input = options.input_is_parallel ? x : ScatterToTensorParallel::apply(x, group);
  at::Tensor output = reduce_from_tensor_parallel(torch::linear(local_input, weight), group);
  return bias.defined() ? output + bias : output;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, GroupPtr group)
    : vocab(vocab), dim(dim), group(std::move(group)) {
  require_divisible("VocabParallelEmbedding", "vocab", vocab, this->group);
  torch::NoGradGuard no_grad;
  at::Tensor whole = torch::empty({vocab, dim});
  torch::nn::init::normal_(whole);  // as torch::nn::Embedding
  weight = register_slice(*this, "weight", whole, 0, this->group);
}

int64_t VocabParallelEmbeddingImpl::vocab_begin() const {
  return rank_of(group) * (vocab / size_of(group));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  if (!is_parallel(group)) return torch::embedding(weight, tokens);
  const int64_t begin = vocab_begin();
  at::Tensor outside = (tokens < begin).logical_or(tokens >= begin + weight.size(0));
  at::Tensor rows = torch::embedding(weight, (tokens - begin).masked_fill(outside, 0));
  return reduce_from_tensor_parallel(rows.masked_fill(outside.unsqueeze(-1), 0.0), group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const GroupPtr& group) {
  if (logits.dim() != 2 || target.dim() != 1 || logits.size(0) != target.size(0)) {
    C10_THROW_ERROR(
        ValueError,
        "vocab_parallel_cross_entropy: expects logits [N, vocab / tp] and target [N]; got "
        "logits " +
            c10::str(logits.sizes()) + " and target " + c10::str(target.sizes()));
  }
  if (!is_parallel(group)) return torch::nn::functional::cross_entropy(logits, target);
  const int64_t part = logits.size(1);
  const int64_t vocab = part * group->size();
  if (target.numel() > 0 &&
      (target.min().item<int64_t>() < 0 || target.max().item<int64_t>() >= vocab)) {
    C10_THROW_ERROR(ValueError, "vocab_parallel_cross_entropy: target ids must lie in [0, " +
                                    std::to_string(vocab) + ") (the whole vocabulary)");
  }
  at::Tensor x = logits.to(at::kFloat);
  // The shift only keeps exp() in range; it does not change the loss, so no gradient.
  at::Tensor max = std::get<0>(x.detach().max(-1));
  all_reduce(max, ReduceOp::kMax, *group).wait();
  at::Tensor shifted = x - max.unsqueeze(-1);
  at::Tensor sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(-1), group);
  const int64_t begin = group->rank() * part;
  at::Tensor outside = (target < begin).logical_or(target >= begin + part);
  at::Tensor target_logit =
      shifted.gather(-1, (target - begin).masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1);
  target_logit = reduce_from_tensor_parallel(target_logit.masked_fill(outside, 0.0), group);
  return (sum_exp.log() - target_logit).mean();
}

}  // namespace hp
