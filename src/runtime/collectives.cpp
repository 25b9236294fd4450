#include "hyperparallel/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <numeric>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "tensor_storage.h"

namespace hp {
namespace {

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

void require_contiguous(const at::Tensor& tensor, const char* op, const char* what) {
  require(tensor.defined(), std::string(op) + ": " + what + " is undefined");
  require(tensor.is_contiguous(),
          std::string(op) + ": " + what + " must be contiguous (call .contiguous())");
}

struct NamedTensor {
  const at::Tensor& tensor;
  const char* name;
};

// `whole` (contiguous) has group size x `part`'s elements, of `part`'s dtype: the two
// sides of an all-gather or a reduce-scatter.
void require_group_multiple(const char* op, NamedTensor whole, NamedTensor part, const Group& group,
                            const std::string& hint) {
  require_contiguous(whole.tensor, op, whole.name);
  require_contiguous(part.tensor, op, part.name);
  require(whole.tensor.numel() == part.tensor.numel() * group.size() &&
              whole.tensor.scalar_type() == part.tensor.scalar_type(),
          std::string(op) + ": " + whole.name + " must have group size (" +
              std::to_string(group.size()) + ") x " + part.name + " numel (" +
              std::to_string(part.tensor.numel()) + ") elements of the " + part.name + "'s dtype" +
              hint + "; got " + std::to_string(whole.tensor.numel()));
}

// Gloo's AVG throws in all-reduce and silently sums in reduce-scatter, so averages are
// computed as SUM followed by a division when the result is consumed.
c10d::ReduceOp backend_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  throw std::logic_error("unknown ReduceOp");
}

std::function<void()> average_after(ReduceOp op, at::Tensor result, int64_t group_size) {
  if (op != ReduceOp::kAvg || group_size == 1) return {};
  if (!at::isFloatingType(result.scalar_type())) {
    throw std::invalid_argument("reduce op avg needs a floating-point tensor, got " +
                                std::string(c10::toString(result.scalar_type())));
  }
  return [result, group_size]() mutable { result.div_(group_size); };
}

c10d::Backend& backend_for(const Group& group, const at::Tensor& tensor) {
  return group.backend(tensor.device().type());
}

void check_peer(int64_t peer, const Group& group, const char* op) {
  require(peer >= 0 && peer < group.size(),
          std::string(op) + ": group rank " + std::to_string(peer) + " is outside group '" +
              group.name() + "' of size " + std::to_string(group.size()));
}

// Gloo's reduce-scatter (torch 2.6) clones the whole input and all-reduces it: every
// rank sends and receives 2(n-1)/n of the input. Sending each chunk straight to its
// owner (all-to-all) moves (n-1)/n, half of that, with no clone; the owner then reduces
// the n chunks it received, in group-rank order (deterministic), accumulating reduced
// precision floats in fp32.
CommHandle reduce_scatter_by_all_to_all(at::Tensor out_flat, at::Tensor in_flat, ReduceOp op,
                                        const Group& group) {
  c10d::Backend& backend = backend_for(group, in_flat);
  const int64_t group_size = group.size();
  at::Tensor received = at::empty_like(in_flat);
  std::vector<int64_t> equal_splits;
  auto work = backend.alltoall_base(received, in_flat, equal_splits, equal_splits);
  std::function<void()> average = average_after(op, out_flat, group_size);
  return CommHandle::from_work(
      std::move(work),
      [=]() mutable {
        const at::Tensor by_source = received.view({group_size, out_flat.numel()});
        switch (op) {
          case ReduceOp::kSum:
          case ReduceOp::kAvg:
            if (at::isReducedFloatingType(out_flat.scalar_type())) {
              out_flat.copy_(at::sum(by_source, {0}, /*keepdim=*/false, at::kFloat));
            } else {
              at::sum_out(out_flat, by_source, {0});
            }
            if (average) average();
            break;
          case ReduceOp::kMax:
            at::amax_out(out_flat, by_source, {0});
            break;
          case ReduceOp::kMin:
            at::amin_out(out_flat, by_source, {0});
            break;
        }
        // The receive buffer goes as soon as it is reduced (the backend may still hold it).
        detail::free_storage(received);
        received = at::Tensor();
      },
      group.on_failure("reduce_scatter"));
}

// The tensor and the peer of a send or receive: another rank of the group.
void check_point_to_point(const at::Tensor& tensor, int64_t peer, const Group& group,
                          const char* op, const char* verb) {
  require_contiguous(tensor, op, "tensor");
  check_peer(peer, group, op);
  require(peer != group.rank(), std::string(op) + ": a rank cannot " + verb + " itself");
}

// Indexed by ReduceOp.
constexpr const char* kReduceOpNames[] = {"sum", "avg", "max", "min"};

}  // namespace

ReduceOp parse_reduce_op(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (lower == "mean") return ReduceOp::kAvg;
  for (size_t i = 0; i < std::size(kReduceOpNames); ++i) {
    if (lower == kReduceOpNames[i]) return static_cast<ReduceOp>(i);
  }
  throw std::invalid_argument("unknown reduce op '" + name +
                              "'; use \"sum\", \"avg\", "
                              "\"max\" or \"min\"");
}

std::string to_string(ReduceOp op) { return kReduceOpNames[static_cast<size_t>(op)]; }

CommHandle all_gather(at::Tensor output, const at::Tensor& input, const Group& group) {
  require_group_multiple("all_gather", {output, "output"}, {input, "input"}, group, "");
  at::Tensor out_flat = output.view(-1);
  at::Tensor in_flat = input.view(-1);
  if (group.size() == 1) {
    out_flat.copy_(in_flat);
    return {};
  }
  return CommHandle::from_work(backend_for(group, input)._allgather_base(out_flat, in_flat), {},
                               group.on_failure("all_gather"));
}

CommHandle reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                          const Group& group) {
  require_group_multiple("reduce_scatter", {input, "input"}, {output, "output"}, group,
                         " (pad the input to a multiple of the group size)");
  at::Tensor out_flat = output.view(-1);
  at::Tensor in_flat = input.view(-1);
  if (group.size() == 1) {
    out_flat.copy_(in_flat);
    return {};
  }
  c10d::Backend& backend = backend_for(group, input);
  if (backend.getBackendName() == "gloo") {
    return reduce_scatter_by_all_to_all(out_flat, in_flat, op, group);
  }
  c10d::ReduceScatterOptions options;
  options.reduceOp = backend_op(op);
  auto work = backend._reduce_scatter_base(out_flat, in_flat, options);
  return CommHandle::from_work(std::move(work), average_after(op, output, group.size()),
                               group.on_failure("reduce_scatter"));
}

CommHandle all_reduce(at::Tensor tensor, ReduceOp op, const Group& group) {
  require_contiguous(tensor, "all_reduce", "tensor");
  if (group.size() == 1) return {};
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = backend_op(op);
  auto work = backend_for(group, tensor).allreduce(tensors, options);
  return CommHandle::from_work(std::move(work), average_after(op, tensor, group.size()),
                               group.on_failure("all_reduce"));
}

CommHandle all_to_all(at::Tensor output, const at::Tensor& input, const Group& group,
                      std::vector<int64_t> output_splits, std::vector<int64_t> input_splits) {
  require_contiguous(output, "all_to_all", "output");
  require_contiguous(input, "all_to_all", "input");
  const auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                                const char* what) {
    if (splits.empty()) {
      require(t.dim() > 0 && t.size(0) % group.size() == 0,
              std::string("all_to_all: without ") + what + " splits, dim 0 of the " + what +
                  " must divide evenly by the group size " + std::to_string(group.size()));
      return;
    }
    require(static_cast<int64_t>(splits.size()) == group.size() &&
                std::all_of(splits.begin(), splits.end(), [](int64_t s) { return s >= 0; }) &&
                std::accumulate(splits.begin(), splits.end(), int64_t{0}) == t.size(0),
            std::string("all_to_all: ") + what +
                " splits need one non-negative entry per "
                "group rank, summing to dim 0 of the " +
                what);
  };
  check_splits(output_splits, output, "output");
  check_splits(input_splits, input, "input");
  if (group.size() == 1) {
    output.copy_(input);
    return {};
  }
  at::Tensor out = output;
  at::Tensor in = input;
  return CommHandle::from_work(
      backend_for(group, input).alltoall_base(out, in, output_splits, input_splits), {},
      group.on_failure("all_to_all"));
}

CommHandle broadcast(at::Tensor tensor, int64_t src, const Group& group) {
  require_contiguous(tensor, "broadcast", "tensor");
  check_peer(src, group, "broadcast");
  if (group.size() == 1) return {};
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  return CommHandle::from_work(backend_for(group, tensor).broadcast(tensors, options), {},
                               group.on_failure("broadcast"));
}

CommHandle send(const at::Tensor& tensor, int64_t dst, const Group& group, int tag) {
  check_point_to_point(tensor, dst, group, "send", "send to");
  std::vector<at::Tensor> tensors{tensor};
  return CommHandle::from_work(
      backend_for(group, tensor).send(tensors, static_cast<int>(dst), tag));
}

CommHandle recv(at::Tensor tensor, int64_t src, const Group& group, int tag) {
  check_point_to_point(tensor, src, group, "recv", "receive from");
  std::vector<at::Tensor> tensors{tensor};
  return CommHandle::from_work(
      backend_for(group, tensor).recv(tensors, static_cast<int>(src), tag));
}

CommHandle barrier(const Group& group) {
  if (group.size() == 1) return {};
  return CommHandle::from_work(group.backend(c10::DeviceType::CPU).barrier(), {},
                               group.on_failure("barrier"));
}

}  // namespace hp
