// The rule that puts a job on GPUs or on the CPU, with faked devices: what each rank sees
// is data here, so the rule is tested without GPUs.
#include <gtest/gtest.h>

#include "src/distributed/device_choice.h"

namespace hp::detail {
namespace {

SeenDevice on_gpu(int64_t rank, int64_t index, std::string gpu) {
  return {rank, index, std::move(gpu), "LOCAL_RANK " + std::to_string(rank)};
}

TEST(DeviceChoice, OneVisibleDeviceIsTheRanksOwnWhateverItsLocalRank) {
  // CUDA_VISIBLE_DEVICES per process (SLURM, Kubernetes): each sees its GPU as cuda:0.
  EXPECT_EQ(own_cuda_index(0, 1), 0);
  EXPECT_EQ(own_cuda_index(3, 1), 0);
}

TEST(DeviceChoice, SeveralVisibleDevicesAreChosenByLocalRank) {
  EXPECT_EQ(own_cuda_index(0, 8), 0);
  EXPECT_EQ(own_cuda_index(5, 8), 5);
  EXPECT_EQ(own_cuda_index(2, 2), std::nullopt);  // more ranks than GPUs on this machine
  EXPECT_EQ(own_cuda_index(0, 0), std::nullopt);
}

TEST(DeviceChoice, RanksOnGpusOfTheirOwnStayOnThem) {
  EXPECT_EQ(why_not_all_on_gpus({on_gpu(0, 0, "hostA GPU-1"), on_gpu(1, 0, "hostA GPU-2"),
                                 on_gpu(2, 0, "hostB GPU-1")}),
            std::nullopt);
}

TEST(DeviceChoice, ARankWithoutAGpuMovesTheJobToTheCpuAndIsNamed) {
  SeenDevice cpu{1, std::nullopt, "", "LOCAL_RANK 1, 0 CUDA device(s) visible"};
  const auto why = why_not_all_on_gpus({on_gpu(0, 0, "hostA GPU-1"), cpu});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("rank 1 has no GPU of its own (LOCAL_RANK 1, 0 CUDA device(s) visible)"),
            std::string::npos)
      << *why;
}

TEST(DeviceChoice, TwoRanksOnOneGpuAreNamed) {
  // One GPU on a machine and two ranks that both see it as cuda:0: NCCL cannot share it.
  const auto why = why_not_all_on_gpus({on_gpu(0, 0, "hostA GPU-1"), on_gpu(1, 0, "hostA GPU-1")});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("ranks 0 and 1 would share one GPU (hostA GPU-1"), std::string::npos) << *why;
}

TEST(DeviceChoice, WhatARankSeesTravelsThroughTheStoreUnchanged) {
  const SeenDevice seen = on_gpu(3, 2, "hostA GPU-7");
  const SeenDevice back = decode(encode(seen));
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.cuda_index, 2);
  EXPECT_EQ(back.gpu, "hostA GPU-7");
  EXPECT_EQ(back.context, seen.context);
  EXPECT_EQ(decode(encode(SeenDevice{4, std::nullopt, "", "x"})).cuda_index, std::nullopt);
}

}  // namespace
}  // namespace hp::detail
