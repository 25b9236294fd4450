#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "block_codec_kernels.h"

namespace hp::detail {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr uint32_t kInfinityBits = 0x7f800000u;

// Adding 1.5 x 2^23 to a value of magnitude below 2^22 leaves a whole number (the sum's
// unit in the last place is 1), rounded to nearest with ties to even as every fp32 sum
// is; subtracting it again is exact. nearbyint's arithmetic without a libm call.
constexpr float kRoundingBias = 12582912.0f;

// Blocks per task of the parallel loop: enough values that a task outweighs its start.
constexpr int64_t kValuesPerTask = 1 << 16;

// Where a block lies in a [rows, n] tensor of blocks_per_row(n, block_size) blocks a row.
struct BlockSpan {
  int64_t row;
  int64_t offset;  // within the row
  int64_t length;  // block_size, or less for a row's last block
};

BlockSpan span_of(int64_t block, int64_t n, int64_t block_size) {
  const int64_t per_row = blocks_per_row(n, block_size);
  const int64_t offset = (block % per_row) * block_size;
  return {block / per_row, offset, std::min(block_size, n - offset)};
}

template <typename Kernel>
void for_each_block(int64_t rows, int64_t n, int64_t block_size, const Kernel& kernel) {
  const int64_t blocks = rows * blocks_per_row(n, block_size);
  const int64_t grain = std::max<int64_t>(1, kValuesPerTask / block_size);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      kernel(block, span_of(block, n, block_size));
    }
  });
}

// The block's largest magnitude over the largest code; NaN when it holds a NaN or an inf
// (as amax, which propagates NaN, and inf / max give in the tensor operations). Without
// their sign bits, floats order as their bits do, the NaNs above inf: an integer maximum,
// which vectorizes, finds the largest magnitude and any NaN at once.
float scale_of(const float* x, int64_t length, float max_code) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < length; ++i) {
    const uint32_t magnitude = c10::bit_cast<uint32_t>(x[i]) & 0x7fffffffu;
    largest = std::max(largest, magnitude);
  }
  if (largest >= kInfinityBits) return kNaN;
  const float scale = c10::bit_cast<float>(largest) / max_code;
  return std::isinf(scale) ? kNaN : scale;
}

void quantize_int8(const float* x, int64_t length, float scale, int8_t* codes) {
  if (!(scale > 0.0f)) {  // zeros, an underflowed scale, or NaN: codes 0
    std::fill_n(codes, length, int8_t{0});
    return;
  }
  for (int64_t i = 0; i < length; ++i) {
    // |x / scale| stays below 191 (127 x 1.5, where a subnormal scale lost up to a third
    // of itself to rounding), so the rounding below is exact and the clamp can be done on
    // integers, which vectorizes.
    const float rounded = (x[i] / scale + kRoundingBias) - kRoundingBias;
    codes[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(rounded), -127, 127));
  }
}

void quantize_fp8(const float* x, int64_t length, float scale, c10::Float8_e4m3fn* codes) {
  const bool usable = scale > 0.0f;
  for (int64_t i = 0; i < length; ++i) {
    // x / scale can exceed 448 by the division's rounding; e4m3fn turns that into NaN.
    const float scaled = usable ? std::clamp(x[i] / scale, -448.0f, 448.0f) : 0.0f;
    codes[i] = c10::Float8_e4m3fn(scaled);
  }
}

// Every e4m3fn code's value, as c10 converts it.
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table{};
    for (int bits = 0; bits < 256; ++bits) {
      table[bits] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    }
    return table;
  }();
  return values;
}

}  // namespace

QuantizedBlocks quantize_blocks_on_cpu(const at::Tensor& values, CommCodec codec,
                                       int64_t block_size) {
  const at::Tensor x = values.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0);
  const int64_t n = x.size(1);
  const c10::ScalarType code_type = codec == CommCodec::kInt8 ? at::kChar : at::kFloat8_e4m3fn;
  at::Tensor codes = at::empty({rows, n}, x.options().dtype(code_type));
  at::Tensor scales = at::empty({rows, blocks_per_row(n, block_size)}, x.options());
  const float* in = x.const_data_ptr<float>();
  float* scale_out = scales.mutable_data_ptr<float>();
  const float max_code = code_max(codec);
  int8_t* int8_codes = codec == CommCodec::kInt8 ? codes.mutable_data_ptr<int8_t>() : nullptr;
  c10::Float8_e4m3fn* fp8_codes =
      codec == CommCodec::kFp8 ? codes.mutable_data_ptr<c10::Float8_e4m3fn>() : nullptr;
  for_each_block(rows, n, block_size, [&](int64_t block, BlockSpan span) {
    const int64_t first = span.row * n + span.offset;
    const float scale = scale_of(in + first, span.length, max_code);
    scale_out[block] = scale;
    if (int8_codes != nullptr) {
      quantize_int8(in + first, span.length, scale, int8_codes + first);
    } else {
      quantize_fp8(in + first, span.length, scale, fp8_codes + first);
    }
  });
  return {codes, scales};
}

at::Tensor dequantize_blocks_on_cpu(const QuantizedBlocks& blocks, int64_t block_size) {
  // Rows of codes may lie apart (the codes of rows received next to their scales).
  const at::Tensor codes = blocks.codes.stride(1) == 1 ? blocks.codes : blocks.codes.contiguous();
  const int64_t code_row_stride = codes.stride(0);
  const at::Tensor scales = blocks.scales.contiguous();
  const int64_t rows = codes.size(0);
  const int64_t n = codes.size(1);
  at::Tensor values = at::empty({rows, n}, scales.options());
  float* out = values.mutable_data_ptr<float>();
  const float* scale_of_block = scales.const_data_ptr<float>();
  // An int8 code is its value; an e4m3fn code's value is looked up by its bits.
  const bool int8 = codes.scalar_type() == at::kChar;
  const int8_t* int8_codes = static_cast<const int8_t*>(codes.const_data_ptr());
  const uint8_t* fp8_bits = static_cast<const uint8_t*>(codes.const_data_ptr());
  const std::array<float, 256>& fp8 = fp8_values();
  for_each_block(rows, n, block_size, [&](int64_t block, BlockSpan span) {
    const int64_t first = span.row * n + span.offset;
    const int64_t first_code = span.row * code_row_stride + span.offset;
    const float scale = scale_of_block[block];
    float* value = out + first;
    if (int8) {
      const int8_t* code = int8_codes + first_code;
      for (int64_t i = 0; i < span.length; ++i) value[i] = static_cast<float>(code[i]) * scale;
    } else {
      const uint8_t* bits = fp8_bits + first_code;
      for (int64_t i = 0; i < span.length; ++i) value[i] = fp8[bits[i]] * scale;
    }
  });
  return values;
}

}  // namespace hp::detail
