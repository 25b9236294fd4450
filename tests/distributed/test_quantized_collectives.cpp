// Quantized all-gather and reduce-scatter on 1-4 ranks, uneven sizes, both codecs and an
// HSDP mesh's groups: bitwise what quantize_blocks / dequantize_blocks give in one
// process on the whole tensors. (A group of one rank quantizes nothing, unless it
// communicates: tests/CMakeLists.txt runs these once more with HP_ONE_RANK_GROUPS_COMMUNICATE=1.)
#include <torch/torch.h>

#include <limits>

#include "distributed_test.h"
#include "error_of.h"
#include "hyperparallel/mesh.h"
#include "hyperparallel/quantized_collectives.h"

namespace hp {
namespace {

using testing::error_of;

constexpr int64_t kBlock = 16;

// Rank r's tensor: different per rank, over several magnitudes.
at::Tensor input_of(int64_t rank, int64_t numel, at::ScalarType dtype) {
  torch::manual_seed(100 + rank);
  return (torch::randn({numel}) * torch::pow(4.0, torch::randint(-3, 3, {numel}).to(at::kFloat)))
      .to(dtype);
}

// The all-gather's result computed in one process: every rank's input quantized as a row.
at::Tensor gathered_here(int64_t ranks, int64_t n, at::ScalarType dtype, CommCodec codec) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < ranks; ++r) {
    rows.push_back(dequantize_blocks(
        quantize_blocks(input_of(r, n, dtype).view({1, n}), codec, kBlock), kBlock, dtype));
  }
  return torch::cat(rows, 1).view(-1);
}

// The reduce-scatter's chunk of `rank`, computed in one process: every rank's chunk for
// it quantized, dequantized in fp32 and summed in rank order.
at::Tensor reduced_here(int64_t ranks, int64_t rank, int64_t chunk, at::ScalarType dtype,
                        CommCodec codec) {
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < ranks; ++r) {
    const at::Tensor rows = input_of(r, chunk * ranks, dtype).view({ranks, chunk});
    parts.push_back(dequantize_blocks(quantize_blocks(rows, codec, kBlock), kBlock, at::kFloat)
                        .select(0, rank));
  }
  return at::sum(torch::stack(parts), {0}).to(dtype);
}

void check_on(const Group& group) {
  for (CommCodec codec : {CommCodec::kInt8, CommCodec::kFp8}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(to_string(codec) + " " + c10::toString(dtype));
      const int64_t n = 37;  // not a multiple of the block, nor of the group size
      at::Tensor gathered = torch::empty({group.size() * n}, dtype);
      quantized_all_gather(gathered, input_of(group.rank(), n, dtype), group, codec, kBlock).wait();
      const at::Tensor expected = !group.communicates()
                                      ? input_of(0, n, dtype)
                                      : gathered_here(group.size(), n, dtype, codec);
      EXPECT_TRUE(torch::equal(gathered, expected));

      at::Tensor reduced = torch::empty({n}, dtype);
      quantized_reduce_scatter(reduced, input_of(group.rank(), n * group.size(), dtype),
                               ReduceOp::kSum, group, codec, kBlock)
          .wait();
      const at::Tensor sum = !group.communicates()
                                 ? input_of(0, n, dtype)
                                 : reduced_here(group.size(), group.rank(), n, dtype, codec);
      EXPECT_TRUE(torch::equal(reduced, sum));

      at::Tensor averaged = torch::empty({n}, at::kFloat);
      if (dtype == at::kFloat) {
        quantized_reduce_scatter(averaged, input_of(group.rank(), n * group.size(), dtype),
                                 ReduceOp::kAvg, group, codec, kBlock)
            .wait();
        EXPECT_TRUE(torch::equal(averaged, sum / group.size()));
      }
    }
  }
}

HP_DIST_TEST(QuantizedCollectives, BitwiseAsInOneProcess, 1, 2, 3, 4) {
  check_on(*testing::world()->world_group());
}

HP_DIST_TEST(QuantizedCollectives, OnTheGroupsOfAnHsdpMesh, 4) {
  const DeviceMesh mesh(testing::world(), {{"replicate", 2}, {"shard", 2}});
  check_on(*mesh.group("shard"));
  check_on(*mesh.group("replicate"));
}

// Several tensors in one collective: each output bitwise what a call per tensor gives
// (blocks of its own), residuals included; the bytes are the same.
HP_DIST_TEST(QuantizedCollectives, CoalescedAsOneCallPerTensor, 2, 3) {
  const Group& group = *testing::world()->world_group();
  const int64_t shards = group.size();
  const std::vector<int64_t> sizes = {37, 5, 64};  // uneven, one below a block
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kFloat};
  std::vector<at::Tensor> inputs, whole_inputs, gathered, reduced, residuals;
  for (size_t i = 0; i < sizes.size(); ++i) {
    inputs.push_back(input_of(group.rank() + 10 * i, sizes[i], dtypes[i]));
    whole_inputs.push_back(input_of(group.rank() + 20 * i, sizes[i] * shards, at::kFloat));
    gathered.push_back(torch::empty({shards * sizes[i]}, dtypes[i]));
    reduced.push_back(torch::empty({sizes[i]}));
    residuals.push_back(torch::full({sizes[i] * shards}, 0.01f * (i + 1)));
  }
  reset_wire_bytes();
  quantized_all_gather_coalesced(gathered, inputs, group, CommCodec::kInt8, kBlock).wait();
  quantized_reduce_scatter_coalesced(reduced, whole_inputs, ReduceOp::kAvg, group, CommCodec::kFp8,
                                     kBlock, residuals)
      .wait();
  const WireBytes together = wire_bytes();
  reset_wire_bytes();
  for (size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    at::Tensor one_gathered = torch::empty_like(gathered[i]);
    quantized_all_gather(one_gathered, inputs[i], group, CommCodec::kInt8, kBlock).wait();
    EXPECT_TRUE(torch::equal(gathered[i], one_gathered));
    at::Tensor one_reduced = torch::empty_like(reduced[i]);
    const at::Tensor residual = torch::full({sizes[i] * shards}, 0.01f * (i + 1));
    quantized_reduce_scatter(one_reduced, whole_inputs[i], ReduceOp::kAvg, group, CommCodec::kFp8,
                             kBlock, residual)
        .wait();
    EXPECT_TRUE(torch::equal(reduced[i], one_reduced));
    EXPECT_TRUE(torch::equal(residuals[i], residual));
  }
  EXPECT_EQ(together.total(), wire_bytes().total());
  EXPECT_NE(error_of([&] {
              quantized_all_gather_coalesced({gathered[0]}, inputs, group, CommCodec::kInt8,
                                             kBlock);
            }).find("as many outputs as inputs"),
            std::string::npos);
}

// One byte per value and 4 per block of 256 against fp32's 4 per value: 0.254x.
HP_DIST_TEST(QuantizedCollectives, WireBytesAreAQuarterOfFp32s, 2, 4) {
  const Group& group = *testing::world()->world_group();
  const int64_t n = 1024;
  const int64_t others = group.size() - 1;
  const int64_t row = quantized_row_bytes(n, 256);
  ASSERT_EQ(row, 1024 + 4 * 4);
  at::Tensor gathered = torch::empty({group.size() * n});
  at::Tensor reduced = torch::empty({n});
  const at::Tensor whole = torch::randn({group.size() * n});

  reset_wire_bytes();
  all_gather(gathered, whole.narrow(0, 0, n), group).wait();
  reduce_scatter(reduced, whole, ReduceOp::kSum, group).wait();
  const WireBytes plain = wire_bytes();
  EXPECT_EQ(plain.all_gather, 4 * n * others);
  EXPECT_EQ(plain.reduce_scatter, 4 * n * others);

  reset_wire_bytes();
  quantized_all_gather(gathered, whole.narrow(0, 0, n), group, CommCodec::kInt8, 256).wait();
  quantized_reduce_scatter(reduced, whole, ReduceOp::kSum, group, CommCodec::kFp8, 256).wait();
  const WireBytes quantized = wire_bytes();
  EXPECT_EQ(quantized.all_gather, row * others);
  EXPECT_EQ(quantized.all_to_all, row * others);
  EXPECT_EQ(quantized.total(), 2 * row * others);
  EXPECT_LT(static_cast<double>(quantized.total()) / plain.total(), 0.26);
}

// The same input reduced 8 times: without error feedback the summed outputs are 8 times
// one call's error off; with it, the residuals carry what each call's codes missed, so
// the sum stays within about one call's error.
HP_DIST_TEST(QuantizedCollectives, ErrorFeedbackKeepsTheSummedErrorOfOneCall, 2, 3) {
  const Group& group = *testing::world()->world_group();
  const int64_t n = 64;
  const int64_t calls = 8;
  const at::Tensor input = input_of(group.rank(), n * group.size(), at::kFloat);
  at::Tensor exact = torch::zeros({n});
  for (int64_t r = 0; r < group.size(); ++r) {
    exact += input_of(r, n * group.size(), at::kFloat).narrow(0, group.rank() * n, n);
  }
  const auto summed_error = [&](const at::Tensor& residual, double* first_call_error) {
    at::Tensor sum = torch::zeros({n});
    for (int64_t call = 0; call < calls; ++call) {
      at::Tensor out = torch::empty({n});
      quantized_reduce_scatter(out, input, ReduceOp::kSum, group, CommCodec::kInt8, kBlock,
                               residual)
          .wait();
      if (call == 0 && first_call_error) {
        *first_call_error = (out - exact).abs().max().item<double>();
      }
      sum += out;
    }
    return (sum - calls * exact).abs().max().item<double>();
  };
  double one_call = 0;
  const double without = summed_error({}, &one_call);
  const at::Tensor residual = torch::zeros({n * group.size()});
  const double with = summed_error(residual, nullptr);
  ASSERT_GT(one_call, 0);
  EXPECT_NEAR(without, calls * one_call, 1e-4 * calls * one_call);
  EXPECT_LE(with, 2 * one_call);
  EXPECT_GT(residual.abs().max().item<double>(), 0) << "nothing was carried over";
  EXPECT_NE(error_of([&] {
              quantized_reduce_scatter(torch::empty({n}), input, ReduceOp::kSum, group,
                                       CommCodec::kInt8, kBlock, torch::zeros({n}));
            }).find("the residual must be a contiguous fp32 tensor of"),
            std::string::npos);
}

// A block holding an inf cannot be carried: its residual is dropped (zero) and counted,
// the other blocks keep theirs, and the next call with finite input is as if the inf
// block had never been sent (a residual of NaN would have made every later output NaN).
HP_DIST_TEST(QuantizedCollectives, ErrorFeedbackDropsANonFiniteBlock, 2, 3) {
  const Group& group = *testing::world()->world_group();
  const int64_t n = 2 * kBlock;  // two blocks per peer's row
  const at::Tensor input = input_of(group.rank(), n * group.size(), at::kFloat);
  at::Tensor poisoned = input.clone();
  poisoned[1] = std::numeric_limits<float>::infinity();  // the first block of peer 0's row
  const at::Tensor residual = torch::zeros({n * group.size()});
  const at::Tensor dropped = torch::zeros({}, torch::kLong);
  quantized_reduce_scatter(torch::empty({n}), poisoned, ReduceOp::kSum, group, CommCodec::kInt8,
                           kBlock, residual, dropped)
      .wait();
  EXPECT_EQ(dropped.item<int64_t>(), 1);
  EXPECT_TRUE(residual.isfinite().all().item<bool>());
  EXPECT_TRUE(torch::equal(residual.narrow(0, 0, kBlock), torch::zeros({kBlock})));
  // The residual of the other blocks is what the same call without the inf keeps.
  const at::Tensor finite_residual = torch::zeros({n * group.size()});
  quantized_reduce_scatter(torch::empty({n}), input, ReduceOp::kSum, group, CommCodec::kInt8,
                           kBlock, finite_residual)
      .wait();
  EXPECT_TRUE(torch::equal(residual.narrow(0, kBlock, n * group.size() - kBlock),
                           finite_residual.narrow(0, kBlock, n * group.size() - kBlock)));
  at::Tensor out = torch::empty({n});
  quantized_reduce_scatter(out, input, ReduceOp::kSum, group, CommCodec::kInt8, kBlock, residual,
                           dropped)
      .wait();
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  EXPECT_EQ(dropped.item<int64_t>(), 1);
}

HP_DIST_TEST(QuantizedCollectives, BadArgumentsAreNamed, 2) {
  const Group& group = *testing::world()->world_group();
  at::Tensor out = torch::empty({8});
  EXPECT_NE(error_of([&] {
              quantized_all_gather(out, torch::ones({3}), group, CommCodec::kInt8, kBlock);
            }).find("output must have group size (2) x input numel (3)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              quantized_reduce_scatter(torch::empty({4}), torch::ones({8}), ReduceOp::kMax, group,
                                       CommCodec::kInt8, kBlock);
            }).find("only sum and avg"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              quantized_all_gather(out, torch::ones({4}, at::kInt), group, CommCodec::kInt8,
                                   kBlock);
            }).find("floating-point"),
            std::string::npos);
}

}  // namespace
}  // namespace hp
