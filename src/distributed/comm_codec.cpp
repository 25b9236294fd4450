#include "hyperparallel/comm_codec.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>

#include "block_codec_kernels.h"

namespace hp {
namespace {

// Indexed by CommCodec.
constexpr std::array<const char*, 3> kCodecNames = {"none", "int8", "fp8"};

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
  return n + 4 * detail::blocks_per_row(n, block_size);
}

QuantizedBlocks quantize_blocks(const at::Tensor& values, CommCodec codec, int64_t block_size) {
  TORCH_CHECK_VALUE(codec != CommCodec::kNone, "quantize_blocks: codec none has nothing to do");
  TORCH_CHECK_VALUE(block_size > 0, "quantize_blocks: block_size must be > 0, got ", block_size);
  TORCH_CHECK_VALUE(values.dim() == 2 && at::isFloatingType(values.scalar_type()),
                    "quantize_blocks: needs a 2-D floating-point tensor [rows, n], got ",
                    values.sizes(), " ", values.scalar_type());
  return values.is_cpu() ? detail::quantize_blocks_on_cpu(values, codec, block_size)
                         : detail::quantize_blocks_by_tensor_ops(values, codec, block_size);
}

at::Tensor dequantize_blocks(const QuantizedBlocks& blocks, int64_t block_size,
                             c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(block_size > 0, "dequantize_blocks: block_size must be > 0, got ", block_size);
  const int64_t rows = blocks.codes.size(0);
  const int64_t n = blocks.codes.size(1);
  const int64_t count = detail::blocks_per_row(n, block_size);
  TORCH_CHECK_VALUE(blocks.scales.sizes() == at::IntArrayRef({rows, count}),
                    "dequantize_blocks: ", count, " scales per row expected for ", n,
                    " codes in blocks of ", block_size, ", got ", blocks.scales.sizes());
  const at::Tensor values = blocks.codes.is_cpu()
                                ? detail::dequantize_blocks_on_cpu(blocks, block_size)
                                : detail::dequantize_blocks_by_tensor_ops(blocks, block_size);
  return values.to(dtype);
}

}  // namespace hp
