#include "hyperparallel/context_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../distributed/autograd_capsule.h"
#include "hyperparallel/collectives.h"

namespace hp {
namespace {

const Group& require_group(const GroupPtr& group, const std::string& caller) {
  if (!group) {
    C10_THROW_ERROR(ValueError, caller +
                                    ": no context-parallel group; pass the group the sequence is "
                                    "split over (e.g. mesh.group(\"cp\"))");
  }
  return *group;
}

int64_t wrapped_dim(const at::Tensor& tensor, int64_t dim, const std::string& caller) {
  if (tensor.dim() == 0 || dim < -tensor.dim() || dim >= tensor.dim()) {
    C10_THROW_ERROR(ValueError, caller + ": dim " + std::to_string(dim) +
                                    " is out of range for a tensor of " +
                                    std::to_string(tensor.dim()) + " dims");
  }
  return dim < 0 ? dim + tensor.dim() : dim;
}

// Checks a call on `tensor` along `dim` (wrapped in place): the group it splits over, or
// null for a group of one rank, where nothing is split.
const Group* split_group(const GroupPtr& group, const at::Tensor& tensor, int64_t& dim,
                         const std::string& caller) {
  const Group& checked = require_group(group, caller);
  dim = wrapped_dim(tensor, dim, caller);
  return checked.size() > 1 ? &checked : nullptr;
}

int64_t chunks_per_rank(SequenceLayout layout) {
  return layout == SequenceLayout::kLoadBalanced ? 2 : 1;
}

// The chunks of the global sequence that group rank `rank` of `ranks` holds, in the order
// it holds them.
std::vector<int64_t> chunks_of_rank(int64_t rank, int64_t ranks, SequenceLayout layout) {
  if (layout == SequenceLayout::kContiguous) return {rank};
  return {rank, 2 * ranks - 1 - rank};
}

void check_global_length(int64_t seq_len, int64_t ranks, SequenceLayout layout,
                         const std::string& caller) {
  const int64_t chunks = chunks_per_rank(layout) * ranks;
  if (seq_len >= 0 && seq_len % chunks == 0) return;
  const std::string n = std::to_string(chunks), cp = std::to_string(ranks);
  if (layout == SequenceLayout::kLoadBalanced) {
    C10_THROW_ERROR(ValueError,
                    caller + ": sequence length " + std::to_string(seq_len) +
                        " is not divisible by 2 x cp = " + n +
                        " (the load-balanced layout cuts it into 2 chunks per rank, cp = " + cp +
                        "); pad or trim the sequence to a multiple of " + n +
                        ", or use SequenceLayout::kContiguous (a multiple of " + cp + ")");
  }
  C10_THROW_ERROR(ValueError, caller + ": sequence length " + std::to_string(seq_len) +
                                  " is not divisible by cp = " + n +
                                  " (the contiguous layout gives each rank one chunk); pad or trim "
                                  "the sequence to a multiple of " +
                                  n);
}

// A rank's part of a load-balanced sequence is two equal chunks.
void check_local_length(int64_t local_len, SequenceLayout layout, const std::string& caller) {
  if (layout != SequenceLayout::kLoadBalanced || local_len % 2 == 0) return;
  C10_THROW_ERROR(ValueError, caller + ": this rank's part has " + std::to_string(local_len) +
                                  " tokens, but the load-balanced layout gives each rank 2 equal "
                                  "chunks, so it must be even; cut the sequence with "
                                  "hp::shard_sequence from a length divisible by 2 x cp");
}

// Keeps the group alive in the autograd graph until backward has used it.
using GroupRef = detail::AutogradCapsule<GroupPtr>;

// Concatenation along dim 0 is what c10d's flat, rank-major all-gather produces.
// Backward reduce-scatters the gradient (sum): every rank read each rank's part, so the
// part's gradient is the sum of theirs.
struct GatherAlongDim0 : torch::autograd::Function<GatherAlongDim0> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local,
                            c10::intrusive_ptr<GroupRef> ref) {
    const Group& group = *ref->value;
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] *= group.size();
    at::Tensor gathered = at::empty(shape, local.options());
    all_gather(gathered, local.contiguous(), group).wait();
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(ref));
    return gathered;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Group& group = *GroupRef::in(ctx->saved_data["group"]);
    std::vector<int64_t> shape = grads[0].sizes().vec();
    shape[0] /= group.size();
    at::Tensor part = at::empty(shape, grads[0].options());
    reduce_scatter(part, grads[0].contiguous(), ReduceOp::kSum, group).wait();
    return {part, at::Tensor()};
  }
};

// The [begin, end) ranges of a global sequence of `seq_len` tokens this rank holds, in
// the order its part lists them; throws naming `caller` when the length does not split.
std::vector<std::pair<int64_t, int64_t>> ranges_of_rank(int64_t seq_len, const Group& group,
                                                        const ContextParallelOptions& options,
                                                        const std::string& caller) {
  check_global_length(seq_len, group.size(), options.layout, caller);
  const int64_t chunk_len = seq_len / (chunks_per_rank(options.layout) * group.size());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t chunk : chunks_of_rank(group.rank(), group.size(), options.layout)) {
    ranges.emplace_back(chunk * chunk_len, (chunk + 1) * chunk_len);
  }
  return ranges;
}

// This rank's part of `global` along `dim`: its ranges, concatenated.
at::Tensor part_of_rank(const at::Tensor& global, int64_t dim, const Group& group,
                        const ContextParallelOptions& options, const std::string& caller) {
  std::vector<at::Tensor> parts;
  for (const auto& [begin, end] : ranges_of_rank(global.size(dim), group, options, caller)) {
    parts.push_back(global.narrow(dim, begin, end - begin));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, dim);
}

}  // namespace

at::Tensor gather_along_dim(const at::Tensor& local, int64_t dim, const GroupPtr& group) {
  if (!split_group(group, local, dim, "hp::gather_along_dim")) return local;
  // Plain autograd views around the gather: the result may be written in place.
  return GatherAlongDim0::apply(local.movedim(dim, 0), c10::make_intrusive<GroupRef>(group))
      .movedim(0, dim);
}

at::Tensor shard_sequence(const at::Tensor& global, const GroupPtr& group,
                          const ContextParallelOptions& options, int64_t seq_dim) {
  const std::string caller = "hp::shard_sequence";
  const Group* split = split_group(group, global, seq_dim, caller);
  if (!split) return global;
  return part_of_rank(global, seq_dim, *split, options, caller);
}

at::Tensor sequence_positions(int64_t seq_len, const GroupPtr& group,
                              const ContextParallelOptions& options,
                              const at::TensorOptions& tensor_options) {
  const std::string caller = "hp::sequence_positions";
  const Group& checked = require_group(group, caller);
  const at::Tensor positions = at::arange(seq_len, tensor_options);
  if (checked.size() == 1) return positions;
  return part_of_rank(positions, 0, checked, options, caller);
}

at::Tensor unshard_sequence(const at::Tensor& local, const GroupPtr& group,
                            const ContextParallelOptions& options, int64_t seq_dim) {
  const std::string caller = "hp::unshard_sequence";
  const Group* split = split_group(group, local, seq_dim, caller);
  if (!split) return local;
  const Group& checked = *split;
  check_local_length(local.size(seq_dim), options.layout, caller);
  at::Tensor gathered = gather_along_dim(local, seq_dim, group);  // parts in rank order
  if (options.layout == SequenceLayout::kContiguous) return gathered;
  const int64_t per_rank = chunks_per_rank(options.layout);
  const int64_t chunk_len = local.size(seq_dim) / per_rank;
  std::vector<at::Tensor> in_global_order(per_rank * checked.size());
  for (int64_t rank = 0; rank < checked.size(); ++rank) {
    const std::vector<int64_t> chunks = chunks_of_rank(rank, checked.size(), options.layout);
    for (int64_t i = 0; i < per_rank; ++i) {
      in_global_order[chunks[i]] =
          gathered.narrow(seq_dim, (rank * per_rank + i) * chunk_len, chunk_len);
    }
  }
  return at::cat(in_global_order, seq_dim);
}

at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const GroupPtr& group,
                                      const ContextParallelOptions& options) {
  const std::string caller = "hp::context_parallel_attention";
  const Group& checked = require_group(group, caller);
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes()) {
    C10_THROW_ERROR(ValueError, caller +
                                    ": q, k and v must all be [batch, heads, local_seq, "
                                    "head_dim]; got q " +
                                    c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " +
                                    c10::str(v.sizes()));
  }
  const int64_t local_len = q.size(2), head_dim = q.size(3);
  if (checked.size() > 1) check_local_length(local_len, options.layout, caller);
  // k and v travel together: one all-gather (and one reduce-scatter in backward).
  at::Tensor kv = unshard_sequence(at::stack({k, v}), group, options, /*seq_dim=*/3);
  at::Tensor keys = kv[0], values = kv[1];  // [B, H, T, hd], global order
  const int64_t seq_len = keys.size(2);
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)) / std::sqrt(double(head_dim));
  const at::TensorOptions position_options = q.options().dtype(at::kLong);
  at::Tensor query_pos = sequence_positions(seq_len, group, options, position_options);
  at::Tensor key_pos = at::arange(seq_len, position_options);
  at::Tensor future = key_pos.unsqueeze(0) > query_pos.unsqueeze(1);  // [T_local, T]
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  // Softmax in fp32: bf16 scores lose the small probabilities.
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(v.scalar_type());
  return at::matmul(probs, values);
}

}  // namespace hp
