#pragma once
// Two implementations of the block codecs' one arithmetic (comm_codec.h): tensor
// operations, which run on any device, and a loop that makes one pass per block on the
// CPU (where the tensor operations' ten passes and temporaries cost more than the bytes
// they save). Both give the same bits; the tests compare them on every case the codecs
// state.

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "hyperparallel/comm_codec.h"

namespace hp::detail {

// The largest code magnitude: int8's symmetric range, e4m3fn's largest finite value.
constexpr float code_max(CommCodec codec) { return codec == CommCodec::kInt8 ? 127.0f : 448.0f; }

constexpr int64_t blocks_per_row(int64_t n, int64_t block_size) {
  return (n + block_size - 1) / block_size;
}

// values: a 2-D floating-point tensor; the arguments are checked by the callers.
QuantizedBlocks quantize_blocks_by_tensor_ops(const at::Tensor& values, CommCodec codec,
                                              int64_t block_size);
QuantizedBlocks quantize_blocks_on_cpu(const at::Tensor& values, CommCodec codec,
                                       int64_t block_size);

// The values in fp32, [rows, n].
at::Tensor dequantize_blocks_by_tensor_ops(const QuantizedBlocks& blocks, int64_t block_size);
at::Tensor dequantize_blocks_on_cpu(const QuantizedBlocks& blocks, int64_t block_size);

}  // namespace hp::detail
