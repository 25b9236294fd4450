#include "hyperparallel/comm_codec.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>

namespace hp {
namespace {

// Indexed by CommCodec.
constexpr std::array<const char*, 3> kCodecNames = {"none", "int8", "fp8"};

// The largest code magnitude: int8's symmetric range, e4m3fn's largest finite value.
double code_max(CommCodec codec) { return codec == CommCodec::kInt8 ? 127.0 : 448.0; }

int64_t blocks_per_row(int64_t n, int64_t block_size) { return (n + block_size - 1) / block_size; }

}  // namespace

CommCodec parse_comm_codec(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  for (size_t i = 0; i < kCodecNames.size(); ++i) {
    if (lower == kCodecNames[i]) return static_cast<CommCodec>(i);
  }
  C10_THROW_ERROR(ValueError,
                  "unknown communication codec '" + name + "'; use \"none\", \"int8\" or \"fp8\"");
}

std::string to_string(CommCodec codec) { return kCodecNames[static_cast<size_t>(codec)]; }

int64_t quantized_row_bytes(int64_t n, int64_t block_size) {
  return n + 4 * blocks_per_row(n, block_size);
}

QuantizedBlocks quantize_blocks(const at::Tensor& values, CommCodec codec, int64_t block_size) {
  TORCH_CHECK_VALUE(codec != CommCodec::kNone, "quantize_blocks: codec none has nothing to do");
  TORCH_CHECK_VALUE(block_size > 0, "quantize_blocks: block_size must be > 0, got ", block_size);
  TORCH_CHECK_VALUE(values.dim() == 2 && at::isFloatingType(values.scalar_type()),
                    "quantize_blocks: needs a 2-D floating-point tensor [rows, n], got ",
                    values.sizes(), " ", values.scalar_type());
  const int64_t rows = values.size(0);
  const int64_t n = values.size(1);
  const int64_t blocks = blocks_per_row(n, block_size);
  // Padded with zeros to whole blocks: zeros change no block's largest magnitude.
  at::Tensor padded = at::zeros({rows, blocks * block_size}, values.options().dtype(at::kFloat));
  padded.narrow(1, 0, n).copy_(values);
  at::Tensor by_block = padded.view({rows, blocks, block_size});
  at::Tensor scales = by_block.abs().amax(-1).div_(code_max(codec));
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

at::Tensor dequantize_blocks(const QuantizedBlocks& blocks, int64_t block_size,
                             c10::ScalarType dtype) {
  const int64_t rows = blocks.codes.size(0);
  const int64_t n = blocks.codes.size(1);
  const int64_t count = blocks_per_row(n, block_size);
  TORCH_CHECK_VALUE(blocks.scales.sizes() == at::IntArrayRef({rows, count}),
                    "dequantize_blocks: ", count, " scales per row expected for ", n,
                    " codes in blocks of ", block_size, ", got ", blocks.scales.sizes());
  at::Tensor padded = at::zeros({rows, count * block_size}, blocks.scales.options());
  padded.narrow(1, 0, n).copy_(blocks.codes);
  padded = padded.view({rows, count, block_size}).mul_(blocks.scales.unsqueeze(-1));
  return padded.view({rows, count * block_size}).narrow(1, 0, n).to(dtype);
}

}  // namespace hp
