#include "hyperparallel/quantized_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#include "collective_arguments.h"

namespace hp {
namespace {

// Tensor after tensor, each row's codes' bytes, then its scales' bytes.
at::Tensor pack(const std::vector<QuantizedBlocks>& tensors) {
  std::vector<at::Tensor> pieces;
  for (const QuantizedBlocks& blocks : tensors) {
    pieces.push_back(blocks.codes.view(at::kByte));
    pieces.push_back(blocks.scales.view(at::kByte));
  }
  return at::cat(pieces, 1);
}

// The blocks of n values a row that start `offset` bytes into each row of `rows`.
QuantizedBlocks unpack(const at::Tensor& rows, int64_t offset, int64_t n, int64_t block_size,
                       CommCodec codec) {
  const c10::ScalarType code_type = codec == CommCodec::kInt8 ? at::kChar : at::kFloat8_e4m3fn;
  const int64_t scale_bytes = quantized_row_bytes(n, block_size) - n;
  // The codes stay where they are (one byte each: a view); the scales are copied out to
  // be aligned floats (always copied: a single row's narrow is already contiguous, at an
  // offset and row stride that floats cannot view).
  return {
      rows.narrow(1, offset, n).view(code_type),
      rows.narrow(1, offset + n, scale_bytes).clone(at::MemoryFormat::Contiguous).view(at::kFloat)};
}

void require_codec(const char* op, CommCodec codec, int64_t block_size) {
  TORCH_CHECK_VALUE(codec != CommCodec::kNone, op,
                    ": codec none quantizes nothing; call the plain collective");
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be > 0, got ", block_size);
}

// Pairs of (whole, part) tensors, one pair per tensor of a coalesced call: of one
// floating-point dtype each, the whole side group size x the part's elements.
void require_parts(const char* op, const std::vector<at::Tensor>& wholes, const char* whole_name,
                   const std::vector<at::Tensor>& parts, const char* part_name,
                   const Group& group) {
  TORCH_CHECK_VALUE(!parts.empty() && wholes.size() == parts.size(), op,
                    ": needs as many outputs as inputs, at least one, got ", wholes.size(), " and ",
                    parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK_VALUE(at::isFloatingType(parts[i].scalar_type()), op,
                      ": quantizes floating-point tensors only, got ", parts[i].scalar_type());
    detail::require_group_multiple(op, {wholes[i], whole_name}, {parts[i], part_name}, group, "");
  }
}

void require_residuals(const std::vector<at::Tensor>& residuals,
                       const std::vector<at::Tensor>& inputs) {
  if (residuals.empty()) return;
  TORCH_CHECK_VALUE(residuals.size() == inputs.size(),
                    "quantized_reduce_scatter: one residual per input, or none; got ",
                    residuals.size(), " for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& residual = residuals[i];
    const at::Tensor& input = inputs[i];
    TORCH_CHECK_VALUE(residual.defined() && residual.is_contiguous() &&
                          residual.scalar_type() == at::kFloat &&
                          residual.numel() == input.numel() && residual.device() == input.device(),
                      "quantized_reduce_scatter: the residual must be a contiguous fp32 tensor of ",
                      input.numel(), " elements on the input's device, got ",
                      residual.defined() ? residual.sizes() : at::IntArrayRef{}, " ",
                      residual.defined() ? residual.scalar_type() : at::kFloat, " on ",
                      residual.defined() ? residual.device() : input.device());
  }
}

}  // namespace

CommHandle quantized_all_gather_coalesced(std::vector<at::Tensor> outputs,
                                          const std::vector<at::Tensor>& inputs, const Group& group,
                                          CommCodec codec, int64_t block_size) {
  require_codec("quantized_all_gather", codec, block_size);
  require_parts("quantized_all_gather", outputs, "output", inputs, "input", group);
  if (!group.communicates()) {
    std::vector<CommHandle> copies;
    for (size_t i = 0; i < inputs.size(); ++i) {
      copies.push_back(all_gather(outputs[i], inputs[i], group));
    }
    return CommHandle::after(std::move(copies), {});
  }
  std::vector<QuantizedBlocks> rows;
  for (const at::Tensor& input : inputs) {
    rows.push_back(quantize_blocks(input.view({1, input.numel()}), codec, block_size));
  }
  const at::Tensor packed = pack(rows);
  rows.clear();
  at::Tensor gathered = at::empty({group.size(), packed.size(1)}, packed.options());
  CommHandle gather = all_gather(gathered, packed, group);
  return CommHandle::after(
      {std::move(gather)}, [outputs, gathered, codec, block_size, shards = group.size()]() mutable {
        int64_t offset = 0;
        for (at::Tensor& output : outputs) {
          const int64_t n = output.numel() / shards;
          output.view({shards, n})
              .copy_(dequantize_blocks(unpack(gathered, offset, n, block_size, codec), block_size,
                                       output.scalar_type()));
          offset += quantized_row_bytes(n, block_size);
        }
        gathered = at::Tensor();
      });
}

CommHandle quantized_all_gather(at::Tensor output, const at::Tensor& input, const Group& group,
                                CommCodec codec, int64_t block_size) {
  return quantized_all_gather_coalesced({std::move(output)}, {input}, group, codec, block_size);
}

CommHandle quantized_reduce_scatter_coalesced(std::vector<at::Tensor> outputs,
                                              const std::vector<at::Tensor>& inputs, ReduceOp op,
                                              const Group& group, CommCodec codec,
                                              int64_t block_size,
                                              const std::vector<at::Tensor>& residuals,
                                              const at::Tensor& dropped_blocks) {
  require_codec("quantized_reduce_scatter", codec, block_size);
  require_parts("quantized_reduce_scatter", inputs, "input", outputs, "output", group);
  TORCH_CHECK_VALUE(op == ReduceOp::kSum || op == ReduceOp::kAvg,
                    "quantized_reduce_scatter: reduce op ", to_string(op),
                    " is not a sum; only sum and avg are quantized");
  require_residuals(residuals, inputs);
  TORCH_CHECK_VALUE(!dropped_blocks.defined() ||
                        (dropped_blocks.dim() == 0 && dropped_blocks.scalar_type() == at::kLong),
                    "quantized_reduce_scatter: dropped_blocks must be an int64 scalar tensor");
  if (!group.communicates()) {
    std::vector<CommHandle> copies;
    for (size_t i = 0; i < inputs.size(); ++i) {
      copies.push_back(reduce_scatter(outputs[i], inputs[i], op, group));
    }
    return CommHandle::after(std::move(copies), {});
  }
  const int64_t peers = group.size();
  std::vector<QuantizedBlocks> rows;  // per input, one row per peer
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = outputs[i].numel();
    at::Tensor values = inputs[i].view({peers, n});
    if (!residuals.empty()) values = values.to(at::kFloat) + residuals[i].view({peers, n});
    rows.push_back(quantize_blocks(values, codec, block_size));
    if (!residuals.empty()) {
      at::Tensor residual = residuals[i].view({peers, n});
      residual.copy_(values - dequantize_blocks(rows.back(), block_size, at::kFloat));
      // A non-finite block's codes are all NaN, and so its residual: all of it dropped.
      residual.masked_fill_(residual.isfinite().logical_not(), 0.0);
      if (dropped_blocks.defined()) {
        dropped_blocks.add_(rows.back().scales.isfinite().logical_not().sum());
      }
    }
  }
  const at::Tensor packed = pack(rows);
  rows.clear();
  at::Tensor received = at::empty_like(packed);
  CommHandle exchange = all_to_all(received, packed, group);
  return CommHandle::after(
      {std::move(exchange)}, [outputs, received, peers, op, codec, block_size]() mutable {
        int64_t offset = 0;
        for (at::Tensor& output : outputs) {
          const int64_t n = output.numel();
          const at::Tensor parts = dequantize_blocks(unpack(received, offset, n, block_size, codec),
                                                     block_size, at::kFloat);
          // One peer after the other, in group-rank order, on every device (a reduction
          // kernel may pair the rows in another order).
          at::Tensor sum = parts[0].clone();
          for (int64_t peer = 1; peer < peers; ++peer) sum.add_(parts[peer]);
          // (By a tensor on the device: the same rounding as a division on the CPU;
          // block_codec_tensor_ops.cpp says why.)
          if (op == ReduceOp::kAvg) {
            sum.div_(at::scalar_tensor(static_cast<double>(peers), sum.options()));
          }
          output.copy_(sum.view(output.sizes()));
          offset += quantized_row_bytes(n, block_size);
        }
        received = at::Tensor();
      });
}

CommHandle quantized_reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                                    const Group& group, CommCodec codec, int64_t block_size,
                                    const at::Tensor& residual, const at::Tensor& dropped_blocks) {
  return quantized_reduce_scatter_coalesced(
      {std::move(output)}, {input}, op, group, codec, block_size,
      residual.defined() ? std::vector<at::Tensor>{residual} : std::vector<at::Tensor>{},
      dropped_blocks);
}

}  // namespace hp
