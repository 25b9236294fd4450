// comm_fusion's buckets: runs of whole parameters, each at most the bucket's bytes on the
// wire, so that under a codec a bucket holds about four times the fp32 values.
#include <gtest/gtest.h>

#include "hyperparallel/comm_codec.h"
#include "src/fsdp/fsdp_collectives.h"

namespace hp::detail {
namespace {

// Parameters of 100, 100, 100 and 300 elements.
const std::vector<int64_t> kOffsets = {0, 100, 200, 300};
constexpr int64_t kTotal = 600;

std::vector<std::pair<size_t, size_t>> runs(int64_t bucket_bytes, const WireFormat& format) {
  std::vector<std::pair<size_t, size_t>> parameters;
  for (const FusionBucket& bucket : fusion_buckets(kOffsets, kTotal, bucket_bytes, format)) {
    EXPECT_EQ(bucket.begin, kOffsets[bucket.first]);
    EXPECT_EQ(bucket.end, bucket.last < kOffsets.size() ? kOffsets[bucket.last] : kTotal);
    parameters.emplace_back(bucket.first, bucket.last);
  }
  return parameters;
}

using Runs = std::vector<std::pair<size_t, size_t>>;

TEST(FusionBuckets, WholeParametersUpToTheBytesOnTheWire) {
  const WireFormat fp32{4, CommCodec::kNone, 256};
  EXPECT_EQ(runs(0, fp32), (Runs{{0, 4}})) << "0: one collective";
  EXPECT_EQ(runs(800, fp32), (Runs{{0, 2}, {2, 3}, {3, 4}}));
  EXPECT_EQ(runs(1, fp32), (Runs{{0, 1}, {1, 2}, {2, 3}, {3, 4}})) << "one parameter at least";
  // int8 in blocks of 100: a parameter of 100 is 104 bytes, 300 is 312.
  const WireFormat int8{4, CommCodec::kInt8, 100};
  EXPECT_EQ(int8.bytes(300), 312);
  EXPECT_EQ(runs(800, int8), (Runs{{0, 4}}));
  EXPECT_EQ(runs(312, int8), (Runs{{0, 3}, {3, 4}}));
  EXPECT_EQ(runs(311, int8), (Runs{{0, 2}, {2, 3}, {3, 4}}));
}

}  // namespace
}  // namespace hp::detail
