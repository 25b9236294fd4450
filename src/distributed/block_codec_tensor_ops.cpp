#include <ATen/ATen.h>

#include <limits>

#include "block_codec_kernels.h"

namespace hp::detail {

QuantizedBlocks quantize_blocks_by_tensor_ops(const at::Tensor& values, CommCodec codec,
                                              int64_t block_size) {
  const int64_t rows = values.size(0);
  const int64_t n = values.size(1);
  const int64_t blocks = blocks_per_row(n, block_size);
  // Padded with zeros to whole blocks: zeros change no block's largest magnitude.
  at::Tensor padded = at::zeros({rows, blocks * block_size}, values.options().dtype(at::kFloat));
  padded.narrow(1, 0, n).copy_(values);
  at::Tensor by_block = padded.view({rows, blocks, block_size});
  // Divided by a tensor on the values' device, not by a host scalar: CUDA turns division
  // by a host scalar into multiplication by its reciprocal, which rounds differently.
  at::Tensor scales =
      by_block.abs().amax(-1).div_(at::scalar_tensor(code_max(codec), padded.options()));
  // amax propagates NaN; inf / max stays inf. Either way the block becomes NaNs.
  scales.masked_fill_(scales.isinf(), std::numeric_limits<float>::quiet_NaN());
  const at::Tensor usable = scales.gt(0).unsqueeze(-1);  // false for 0 and NaN
  at::Tensor scaled =
      at::where(usable, by_block / scales.unsqueeze(-1), at::zeros({}, padded.options()));
  at::Tensor codes;
  if (codec == CommCodec::kInt8) {
    codes = scaled.round_().clamp_(-127, 127).to(at::kChar);
  } else {
    // x / scale can exceed 448 by the division's rounding; e4m3fn turns that into NaN.
    codes = scaled.clamp_(-448, 448).to(at::kFloat8_e4m3fn);
  }
  return {codes.view({rows, blocks * block_size}).narrow(1, 0, n).contiguous(), scales};
}

at::Tensor dequantize_blocks_by_tensor_ops(const QuantizedBlocks& blocks, int64_t block_size) {
  const int64_t rows = blocks.codes.size(0);
  const int64_t n = blocks.codes.size(1);
  const int64_t count = blocks_per_row(n, block_size);
  at::Tensor padded = at::zeros({rows, count * block_size}, blocks.scales.options());
  padded.narrow(1, 0, n).copy_(blocks.codes);
  padded = padded.view({rows, count, block_size}).mul_(blocks.scales.unsqueeze(-1));
  return padded.view({rows, count * block_size}).narrow(1, 0, n);
}

}  // namespace hp::detail
