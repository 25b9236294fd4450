// The block codecs of comm_codec.h: int8 within half a step of every value, fp8 exactly
// c10's float8 e4m3fn rounding, the stated handling of zeros, subnormals, inf and NaN,
// blocks that do not divide a row, and the CPU loop giving the tensor operations' bits.
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "error_of.h"
#include "hyperparallel/comm_codec.h"
#include "src/distributed/block_codec_kernels.h"

namespace hp {
namespace {

using testing::error_of;

// Values over several orders of magnitude, so that blocks get very different scales.
at::Tensor spread(int64_t rows, int64_t n) {
  torch::manual_seed(0);
  return torch::randn({rows, n}) *
         torch::pow(10.0, torch::randint(-6, 6, {rows, n}).to(at::kFloat));
}

// Each block's scale, repeated for its values: [rows, n].
at::Tensor scale_of_each_value(const QuantizedBlocks& blocks, int64_t n, int64_t block) {
  return blocks.scales.repeat_interleave(block, 1).narrow(1, 0, n);
}

TEST(CommCodec, Int8IsWithinHalfAStepOfEveryValue) {
  for (int64_t block : {1, 7, 256, 1000}) {  // 1000 does not divide a row of 777
    SCOPED_TRACE("block " + std::to_string(block));
    const at::Tensor x = spread(3, 777);
    const QuantizedBlocks q = quantize_blocks(x, CommCodec::kInt8, block);
    ASSERT_EQ(q.codes.scalar_type(), at::kChar);
    ASSERT_EQ(q.codes.sizes(), x.sizes());
    ASSERT_EQ(q.scales.size(1), (777 + block - 1) / block);
    const at::Tensor back = dequantize_blocks(q, block, at::kFloat);
    const at::Tensor scale = scale_of_each_value(q, 777, block);
    // Exact bound, evaluated in double: half a step, plus fp32's rounding of x / scale
    // and of code x scale (each at most 2^-24 relative to at most 127 steps).
    const at::Tensor error = (x.to(at::kDouble) - back.to(at::kDouble)).abs();
    EXPECT_TRUE(error.le(scale.to(at::kDouble) * (0.5 + std::ldexp(1.0, -16))).all().item<bool>())
        << "worst error in steps: " << (error / scale.to(at::kDouble)).max().item<double>();
    // Each block uses the whole code range: its largest magnitude is code +-127.
    const at::Tensor largest = q.codes.abs().to(at::kInt).view({3, -1});
    EXPECT_EQ(largest.max().item<int>(), 127);
  }
}

TEST(CommCodec, Fp8IsE4m3fnRoundingOfTheScaledValues) {
  const int64_t block = 64;
  const at::Tensor x = spread(2, 300);
  const QuantizedBlocks q = quantize_blocks(x, CommCodec::kFp8, block);
  ASSERT_EQ(q.codes.scalar_type(), at::kFloat8_e4m3fn);
  const at::Tensor scale = scale_of_each_value(q, 300, block);
  EXPECT_TRUE(
      torch::equal(q.scales.narrow(1, 0, 4),
                   x.abs().view({2, -1}).narrow(1, 0, 256).view({2, 4, 64}).amax(-1).div(448)))
      << "the first four blocks' scales";
  // The codes are c10's conversion of x / scale (clamped to e4m3fn's finite range).
  const at::Tensor expected = (x / scale).clamp(-448, 448).to(at::kFloat8_e4m3fn);
  EXPECT_TRUE(torch::equal(q.codes.view(at::kByte), expected.view(at::kByte)));
  const at::Tensor back = dequantize_blocks(q, block, at::kFloat);
  EXPECT_TRUE(torch::equal(back, q.codes.to(at::kFloat) * scale));
  // Three mantissa bits: within 1/16 of the value above e4m3fn's subnormals (2^-6).
  const at::Tensor normal = (x / scale).abs().ge(std::ldexp(1.0, -6));
  const at::Tensor relative = ((back - x).abs() / x.abs()).masked_select(normal);
  EXPECT_LE(relative.max().item<double>(), 1.0 / 16);
}

// The cases the codecs state, in blocks of 4: zeros (one of them -0); normal values; one
// inf; one NaN; subnormals whose scale underflows; subnormals that keep a scale; ties,
// x / scale = k + 1/2 exactly (scale 1: the block's largest magnitude is 127 or 448);
// subnormal scales rounded down so far that x / scale leaves the code range (int8, fp8).
at::Tensor stated_cases() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float subnormal = std::numeric_limits<float>::denorm_min();
  return torch::tensor({0.f,       0.f,       -0.f,   0.f,  1.f,      -2.f,      0.5f,  3.f,
                        1.f,       inf,       2.f,    -inf, nan,      1.f,       2.f,   3.f,
                        subnormal, 0.f,       0.f,    0.f,  1e-39f,   -2e-39f,   0.f,   5e-39f,
                        127.f,     0.5f,      -1.5f,  2.5f, -127.f,   126.5f,    -3.5f, -0.f,
                        448.f,     0.5f,      -1.5f,  17.f, -448.f,   9.f,       -19.f, 0.25f,
                        2.5e-43f,  -2.5e-43f, 1e-43f, 0.f,  8.8e-43f, -8.8e-43f, 0.f,   3e-43f})
      .view({1, -1});
}

// Equal bits, NaNs included (torch::equal finds no NaN equal).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const c10::ScalarType as_integers = a.element_size() == 1 ? at::kByte : at::kInt;
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         torch::equal(a.contiguous().view(as_integers), b.contiguous().view(as_integers));
}

TEST(CommCodec, ZerosSubnormalsInfAndNaNAreHandledAsStated) {
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    SCOPED_TRACE(to_string(codec));
    const at::Tensor x = stated_cases();
    const at::Tensor back = dequantize_blocks(quantize_blocks(x, codec, 4), 4, at::kFloat);
    EXPECT_TRUE(back.narrow(1, 0, 4).eq(0).all().item<bool>());
    EXPECT_TRUE(back.narrow(1, 4, 4).isfinite().all().item<bool>());
    EXPECT_TRUE(back.narrow(1, 8, 4).isnan().all().item<bool>()) << "an inf makes its block NaN";
    EXPECT_TRUE(back.narrow(1, 12, 4).isnan().all().item<bool>()) << "a NaN makes its block NaN";
    EXPECT_TRUE(back.narrow(1, 16, 4).eq(0).all().item<bool>()) << "the scale underflows: zeros";
    const at::Tensor small = back.narrow(1, 20, 4);
    EXPECT_TRUE(small.isfinite().all().item<bool>());
    EXPECT_LT((small - x.narrow(1, 20, 4)).abs().max().item<double>(), 1e-40);
  }
  // Ties go to the even code.
  const at::Tensor ties = quantize_blocks(stated_cases(), CommCodec::kInt8, 4).codes;
  EXPECT_TRUE(
      torch::equal(ties.narrow(1, 24, 8).to(at::kInt),
                   torch::tensor({127, 0, -2, 2, -127, 126, -4, 0}, torch::kInt).view({1, 8})));
}

TEST(CommCodec, TheCpuLoopGivesTheTensorOperationsBits) {
  const std::vector<at::Tensor> inputs = {stated_cases(), spread(3, 777),
                                          spread(2, 300).to(at::kBFloat16),
                                          spread(2, 300).to(at::kDouble)};
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    for (int64_t block : {1, 4, 7, 256, 1000}) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        SCOPED_TRACE(to_string(codec) + ", block " + std::to_string(block) + ", input " +
                     std::to_string(i));
        const QuantizedBlocks loop = detail::quantize_blocks_on_cpu(inputs[i], codec, block);
        const QuantizedBlocks ops = detail::quantize_blocks_by_tensor_ops(inputs[i], codec, block);
        EXPECT_TRUE(same_bits(loop.codes, ops.codes));
        EXPECT_TRUE(same_bits(loop.scales, ops.scales));
        EXPECT_TRUE(same_bits(detail::dequantize_blocks_on_cpu(ops, block),
                              detail::dequantize_blocks_by_tensor_ops(ops, block)));
      }
    }
  }
  // Every code a peer could send, including e4m3fn's NaNs, decodes alike; its rows lie
  // apart, as received next to their scales.
  const at::Tensor received_rows = torch::zeros({2, 140}, torch::kByte);
  received_rows.narrow(1, 0, 128).copy_(torch::arange(256, torch::kInt).view({2, 128}));
  const at::Tensor all_bytes = received_rows.narrow(1, 0, 128);
  const at::Tensor scales = torch::tensor({0.5f, -3.f, 1e-30f, 7.f}).view({2, 2});
  for (c10::ScalarType code_type : {at::kChar, at::kFloat8_e4m3fn}) {
    const QuantizedBlocks received{all_bytes.view(code_type), scales};
    EXPECT_TRUE(same_bits(detail::dequantize_blocks_on_cpu(received, 64),
                          detail::dequantize_blocks_by_tensor_ops(received, 64)));
  }
}

TEST(CommCodec, LowPrecisionInputsAndOutputs) {
  const at::Tensor x = spread(2, 100).to(at::kBFloat16);
  const QuantizedBlocks q = quantize_blocks(x, CommCodec::kInt8, 32);
  const at::Tensor back = dequantize_blocks(q, 32, at::kBFloat16);
  EXPECT_EQ(back.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::equal(back, dequantize_blocks(q, 32, at::kFloat).to(at::kBFloat16)));
}

TEST(CommCodec, BadArgumentsAreNamed) {
  const at::Tensor x = torch::ones({2, 8});
  EXPECT_NE(error_of([&] { quantize_blocks(x, CommCodec::kInt8, 0); }).find("block_size"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_blocks(x.view(-1), CommCodec::kInt8, 4); }).find("2-D"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_blocks(x, CommCodec::kNone, 4); }).find("none"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_comm_codec("int4"); }).find("\"int8\""), std::string::npos);
  EXPECT_EQ(parse_comm_codec("FP8"), CommCodec::kFp8);
  EXPECT_EQ(to_string(CommCodec::kInt8), "int8");
}

TEST(CommCodec, RowBytes) {
  EXPECT_EQ(quantized_row_bytes(256, 256), 260);
  EXPECT_EQ(quantized_row_bytes(257, 256), 265);
}

}  // namespace
}  // namespace hp
