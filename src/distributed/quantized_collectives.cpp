#include "hyperparallel/quantized_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

namespace hp {
namespace {

// One row per quantized row: its codes' bytes, then its scales' bytes.
at::Tensor pack(const QuantizedBlocks& blocks) {
  return at::cat({blocks.codes.view(at::kByte), blocks.scales.view(at::kByte)}, 1);
}

QuantizedBlocks unpack(const at::Tensor& rows, int64_t n, CommCodec codec) {
  const c10::ScalarType code_type = codec == CommCodec::kInt8 ? at::kChar : at::kFloat8_e4m3fn;
  // The codes stay where they are (one byte each: a view); the scales are copied out to
  // be aligned floats.
  return {rows.narrow(1, 0, n).view(code_type),
          rows.narrow(1, n, rows.size(1) - n).contiguous().view(at::kFloat)};
}

void require_codec(const char* op, CommCodec codec, int64_t block_size) {
  TORCH_CHECK_VALUE(codec != CommCodec::kNone, op,
                    ": codec none quantizes nothing; call the plain collective");
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be > 0, got ", block_size);
}

void require_parts(const char* op, const at::Tensor& whole, const at::Tensor& part,
                   const Group& group) {
  TORCH_CHECK_VALUE(whole.is_contiguous() && part.is_contiguous(), op,
                    ": input and output must be contiguous (call .contiguous())");
  TORCH_CHECK_VALUE(
      at::isFloatingType(part.scalar_type()) && whole.scalar_type() == part.scalar_type(), op,
      ": input and output must have one floating-point dtype, got ", whole.scalar_type(), " and ",
      part.scalar_type());
  TORCH_CHECK_VALUE(whole.numel() == part.numel() * group.size(), op, ": the whole side must have ",
                    "group size (", group.size(), ") x ", part.numel(), " elements, got ",
                    whole.numel());
}

}  // namespace

CommHandle quantized_all_gather(at::Tensor output, const at::Tensor& input, const Group& group,
                                CommCodec codec, int64_t block_size) {
  require_codec("quantized_all_gather", codec, block_size);
  require_parts("quantized_all_gather", output, input, group);
  if (!group.communicates()) return all_gather(std::move(output), input, group);
  const int64_t n = input.numel();
  const at::Tensor packed = pack(quantize_blocks(input.view({1, n}), codec, block_size));
  at::Tensor gathered = at::empty({group.size(), packed.size(1)}, packed.options());
  CommHandle gather = all_gather(gathered, packed, group);
  return CommHandle::after({std::move(gather)}, [output, gathered, n, codec, block_size,
                                                 shards = group.size()]() mutable {
    output.view({shards, n})
        .copy_(dequantize_blocks(unpack(gathered, n, codec), block_size, output.scalar_type()));
    gathered = at::Tensor();
  });
}

CommHandle quantized_reduce_scatter(at::Tensor output, const at::Tensor& input, ReduceOp op,
                                    const Group& group, CommCodec codec, int64_t block_size,
                                    const at::Tensor& residual) {
  require_codec("quantized_reduce_scatter", codec, block_size);
  require_parts("quantized_reduce_scatter", input, output, group);
  TORCH_CHECK_VALUE(op == ReduceOp::kSum || op == ReduceOp::kAvg,
                    "quantized_reduce_scatter: reduce op ", to_string(op),
                    " is not a sum; only sum and avg are quantized");
  if (!group.communicates()) return reduce_scatter(std::move(output), input, op, group);
  const int64_t n = output.numel();
  const int64_t peers = group.size();
  at::Tensor values = input.view({peers, n});
  if (residual.defined()) {
    TORCH_CHECK_VALUE(residual.is_contiguous() && residual.scalar_type() == at::kFloat &&
                          residual.numel() == input.numel() && residual.device() == input.device(),
                      "quantized_reduce_scatter: the residual must be a contiguous fp32 tensor of ",
                      input.numel(), " elements on the input's device, got ", residual.sizes(), " ",
                      residual.scalar_type(), " on ", residual.device());
    values = values.to(at::kFloat) + residual.view({peers, n});
  }
  const QuantizedBlocks blocks = quantize_blocks(values, codec, block_size);
  if (residual.defined()) {
    residual.view({peers, n}).copy_(values - dequantize_blocks(blocks, block_size, at::kFloat));
  }
  const at::Tensor packed = pack(blocks);
  at::Tensor received = at::empty_like(packed);
  CommHandle exchange = all_to_all(received, packed, group);
  return CommHandle::after({std::move(exchange)}, [output, received, n, peers, op, codec,
                                                   block_size]() mutable {
    const at::Tensor parts = dequantize_blocks(unpack(received, n, codec), block_size, at::kFloat);
    received = at::Tensor();
    at::Tensor sum = at::sum(parts, {0});
    if (op == ReduceOp::kAvg) sum.div_(static_cast<double>(peers));
    output.copy_(sum.view(output.sizes()));
  });
}

}  // namespace hp
