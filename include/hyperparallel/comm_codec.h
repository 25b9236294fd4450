#pragma once
// Codecs for what collectives move: fewer bytes on the wire at the loss of full
// precision (as DeepSpeed's ZeRO++ quantizes its weight all-gather and gradient
// exchange). A tensor is cut into blocks of `block_size` consecutive values along each
// row; each block travels as one byte per value plus one fp32 scale.
//
//   kInt8: scale = max|x| / 127, code = x / scale rounded to nearest (ties to even),
//          value = code x scale. |x - value| <= scale x (1/2 + 2^-16): half a step, plus
//          the fp32 rounding of the division and of the product.
//   kFp8:  scale = max|x| / 448, code = x / scale in float8 e4m3fn (round to nearest
//          even, as c10::Float8_e4m3fn converts; 3 mantissa bits, so the error is
//          relative: at most 1/16 of the value, down to e4m3fn's subnormals),
//          value = code x scale.
//
// A block of zeros is all zeros (scale 0). A block holding an inf or a NaN comes back as
// NaNs, all of it, so that non-finite checks downstream (gradient clipping's norm) see it.
// A block whose largest magnitude is so small that its scale underflows to 0 (below about
// 1.8e-43) comes back as zeros.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace hp {

enum class CommCodec { kNone, kInt8, kFp8 };

// "none", "int8", "fp8"; throws c10::ValueError naming the accepted values.
CommCodec parse_comm_codec(const std::string& name);
std::string to_string(CommCodec codec);

struct QuantizedBlocks {
  at::Tensor codes;   // [rows, n]: int8 (kInt8) or float8_e4m3fn (kFp8)
  at::Tensor scales;  // [rows, ceil(n / block_size)] fp32
};

// Quantizes the rows of a 2-D floating-point tensor [rows, n] blockwise (a row's last
// block may be shorter). On the tensor's device.
QuantizedBlocks quantize_blocks(const at::Tensor& values, CommCodec codec, int64_t block_size);

// The values the codes stand for, [rows, n] in `dtype`.
at::Tensor dequantize_blocks(const QuantizedBlocks& blocks, int64_t block_size,
                             c10::ScalarType dtype);

// Bytes one row of n values takes on the wire: n codes plus 4 per block.
int64_t quantized_row_bytes(int64_t n, int64_t block_size);

}  // namespace hp
