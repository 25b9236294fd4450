#include "hyperparallel/collectives.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <numeric>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <utility>

#include "collective_arguments.h"
#include "group_access.h"
#include "tensor_storage.h"
#include "thread_wire_bytes.h"

namespace hp {
namespace {

// Indexed as WireBytes' fields.
enum WireCounter {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kBroadcast,
  kSend,
  kCounters
};
std::array<std::atomic<int64_t>, kCounters> wire_counters{};
thread_local int64_t sent_by_this_thread = 0;

void count_sent(WireCounter counter, int64_t bytes) {
  wire_counters[counter].fetch_add(bytes, std::memory_order_relaxed);
  sent_by_this_thread += bytes;
}

int64_t bytes_of(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

using detail::NamedTensor;
using detail::require;
using detail::require_contiguous;
using detail::require_group_multiple;

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
  C10_THROW_ERROR(Error, "unknown ReduceOp");
}

std::function<void()> average_after(ReduceOp op, at::Tensor result, int64_t group_size) {
  if (op != ReduceOp::kAvg || group_size == 1) return {};
  if (!at::isFloatingType(result.scalar_type())) {
    C10_THROW_ERROR(ValueError, "reduce op avg needs a floating-point tensor, got " +
                                    std::string(c10::toString(result.scalar_type())));
  }
  return [result, group_size]() mutable { result.div_(group_size); };
}

// How a collective's tensors reach the group's backend. A CPU tensor on a group without
// a CPU backend (a GPU World's, unless WorldOptions::gloo_on_gpu) goes through the group's
// device: copied there when issued and back when the collective completes. Other tensors
// go as they are.
class Transport {
 public:
  Transport(const Group& group, const at::Tensor& tensor)
      : staged_(tensor.device().is_cpu() && !group.has_cpu_backend()),
        device_(group.device()),
        backend_(detail::GroupAccess::backend(group,
                                              staged_ ? device_.type() : tensor.device().type())) {}

  c10d::Backend& backend() const { return backend_; }
  // What the backend reads.
  at::Tensor input(const at::Tensor& tensor) {
    if (!staged_) return tensor;
    inputs_.push_back(tensor.to(device_));
    return inputs_.back();
  }
  // What the backend writes (and, `read_too`, reads first): copied into `tensor` on
  // completion.
  at::Tensor output(const at::Tensor& tensor, bool read_too = false) {
    if (!staged_) return tensor;
    at::Tensor on_device =
        read_too ? tensor.to(device_) : at::empty_like(tensor, tensor.options().device(device_));
    copy_back_.emplace_back(tensor, on_device);
    return on_device;
  }
  // The completion callback: the copies back, then `then`. The staged tensors live until
  // the device has run the collective (the work's wait only orders the current stream
  // after it), so their memory is never reused under it.
  std::function<void()> completion(std::function<void()> then) {
    if (!staged_) return then;
    return [copy_back = std::move(copy_back_), keep = std::move(inputs_), device = device_,
            then = std::move(then)]() mutable {
      c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
      for (auto& [host, on_device] : copy_back) host.copy_(on_device);
      copy_back.clear();
      keep.clear();
      if (then) then();
    };
  }

 private:
  bool staged_;
  c10::Device device_;
  c10d::Backend& backend_;
  std::vector<at::Tensor> inputs_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;  // (the caller's, on device)
};

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
  c10d::Backend& backend = detail::GroupAccess::backend(group, in_flat.device().type());
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
      detail::GroupAccess::on_failure(group, "reduce_scatter", backend));
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
  C10_THROW_ERROR(ValueError, "unknown reduce op '" + name +
                                  "'; use \"sum\", \"avg\", "
                                  "\"max\" or \"min\"");
}

std::string to_string(ReduceOp op) { return kReduceOpNames[static_cast<size_t>(op)]; }

// The flat views of a collective's output and input; for a group of one rank the input
// is copied over and nothing is left to communicate (nullopt).
std::optional<std::pair<at::Tensor, at::Tensor>> flat_views_to_communicate(const at::Tensor& output,
                                                                           const at::Tensor& input,
                                                                           const Group& group) {
  at::Tensor out_flat = output.view(-1);
  at::Tensor in_flat = input.view(-1);
  if (!group.communicates()) {
    out_flat.copy_(in_flat);
    return std::nullopt;
  }
  return std::make_pair(out_flat, in_flat);
}

CommHandle all_gather(at::Tensor output, const at::Tensor& input, const Group& group) {
  require_group_multiple("all_gather", {output, "output"}, {input, "input"}, group, "");
  auto flat = flat_views_to_communicate(output, input, group);
  if (!flat) return {};
  auto [out_flat, in_flat] = *flat;
  count_sent(kAllGather, bytes_of(in_flat) * (group.size() - 1));
  Transport transport(group, input);
  at::Tensor out = transport.output(out_flat);
  at::Tensor in = transport.input(in_flat);
  auto work = transport.backend()._allgather_base(out, in);
  return CommHandle::from_work(
      std::move(work), transport.completion({}),
      detail::GroupAccess::on_failure(group, "all_gather", transport.backend()));
}

CommHandle reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                          const Group& group) {
  require_group_multiple("reduce_scatter", {input, "input"}, {output, "output"}, group,
                         " (pad the input to a multiple of the group size)");
  auto flat = flat_views_to_communicate(output, input, group);
  if (!flat) return {};
  auto [out_flat, in_flat] = *flat;
  count_sent(kReduceScatter, bytes_of(in_flat) / group.size() * (group.size() - 1));
  Transport transport(group, input);
  if (transport.backend().getBackendName() == "gloo") {
    return reduce_scatter_by_all_to_all(out_flat, in_flat, op, group);
  }
  c10d::ReduceScatterOptions options;
  options.reduceOp = backend_op(op);
  at::Tensor out = transport.output(out_flat);
  at::Tensor in = transport.input(in_flat);
  auto work = transport.backend()._reduce_scatter_base(out, in, options);
  return CommHandle::from_work(
      std::move(work), transport.completion(average_after(op, output, group.size())),
      detail::GroupAccess::on_failure(group, "reduce_scatter", transport.backend()));
}

CommHandle all_reduce(at::Tensor tensor, ReduceOp op, const Group& group) {
  require_contiguous(tensor, "all_reduce", "tensor");
  if (!group.communicates()) return {};
  count_sent(kAllReduce, 2 * bytes_of(tensor) / group.size() * (group.size() - 1));
  Transport transport(group, tensor);
  std::vector<at::Tensor> tensors{transport.output(tensor, /*read_too=*/true)};
  c10d::AllreduceOptions options;
  options.reduceOp = backend_op(op);
  auto work = transport.backend().allreduce(tensors, options);
  return CommHandle::from_work(
      std::move(work), transport.completion(average_after(op, tensor, group.size())),
      detail::GroupAccess::on_failure(group, "all_reduce", transport.backend()));
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
  if (!group.communicates()) {
    output.copy_(input);
    return {};
  }
  const int64_t row_bytes = input.size(0) == 0 ? 0 : bytes_of(input) / input.size(0);
  const int64_t own_rows =
      input_splits.empty() ? input.size(0) / group.size() : input_splits[group.rank()];
  count_sent(kAllToAll, (input.size(0) - own_rows) * row_bytes);
  Transport transport(group, input);
  at::Tensor out = transport.output(output);
  at::Tensor in = transport.input(input);
  auto work = transport.backend().alltoall_base(out, in, output_splits, input_splits);
  return CommHandle::from_work(
      std::move(work), transport.completion({}),
      detail::GroupAccess::on_failure(group, "all_to_all", transport.backend()));
}

CommHandle broadcast(at::Tensor tensor, int64_t src, const Group& group) {
  require_contiguous(tensor, "broadcast", "tensor");
  check_peer(src, group, "broadcast");
  if (!group.communicates()) return {};
  if (src == group.rank()) count_sent(kBroadcast, bytes_of(tensor) * (group.size() - 1));
  Transport transport(group, tensor);
  std::vector<at::Tensor> tensors{transport.output(tensor, /*read_too=*/true)};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  auto work = transport.backend().broadcast(tensors, options);
  return CommHandle::from_work(
      std::move(work), transport.completion({}),
      detail::GroupAccess::on_failure(group, "broadcast", transport.backend()));
}

CommHandle send(const at::Tensor& tensor, int64_t dst, const Group& group, int tag,
                const std::string& what) {
  check_point_to_point(tensor, dst, group, "send", "send to");
  count_sent(kSend, bytes_of(tensor));
  Transport transport(group, tensor);
  std::vector<at::Tensor> tensors{transport.input(tensor)};
  auto work = transport.backend().send(tensors, static_cast<int>(dst), tag);
  return CommHandle::from_work(
      std::move(work), transport.completion({}),
      detail::GroupAccess::on_transfer_failure(group, what, /*sending=*/true, dst, tag));
}

CommHandle recv(at::Tensor tensor, int64_t src, const Group& group, int tag,
                const std::string& what) {
  check_point_to_point(tensor, src, group, "recv", "receive from");
  Transport transport(group, tensor);
  std::vector<at::Tensor> tensors{transport.output(tensor)};
  auto work = transport.backend().recv(tensors, static_cast<int>(src), tag);
  return CommHandle::from_work(
      std::move(work), transport.completion({}),
      detail::GroupAccess::on_transfer_failure(group, what, /*sending=*/false, src, tag));
}

CommHandle barrier(const Group& group) {
  if (!group.communicates()) return {};
  // Gloo where the group has it; else NCCL's barrier, an all-reduce on the bound GPU.
  const c10::DeviceType on = group.has_cpu_backend() ? c10::kCPU : group.device().type();
  c10d::Backend& backend = detail::GroupAccess::backend(group, on);
  return CommHandle::from_work(backend.barrier(), {},
                               detail::GroupAccess::on_failure(group, "barrier", backend));
}

WireBytes wire_bytes() {
  const auto read = [](WireCounter c) { return wire_counters[c].load(std::memory_order_relaxed); };
  return {read(kAllGather), read(kReduceScatter), read(kAllReduce),
          read(kAllToAll),  read(kBroadcast),     read(kSend)};
}

void reset_wire_bytes() {
  for (auto& counter : wire_counters) counter.store(0, std::memory_order_relaxed);
}

int64_t detail::wire_bytes_sent_by_this_thread() { return sent_by_this_thread; }

}  // namespace hp
