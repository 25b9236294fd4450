// Every collective on 1-4 ranks, fp32 and bf16, against values computed locally.
#include <torch/torch.h>

#include <string>
#include <thread>

#include "distributed_test.h"
#include "error_of.h"
#include "hyperparallel/collectives.h"
#include "src/distributed/thread_wire_bytes.h"

namespace hp {
namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16};

// Rank r's contribution: small integers (exact in bf16) that differ per rank and element.
at::Tensor contribution(int64_t rank, int64_t numel, at::ScalarType dtype) {
  return (torch::arange(numel, torch::kFloat) % 7 + 3 * rank + 1).to(dtype);
}

const Group& world_group() { return *testing::world()->world_group(); }

HP_DIST_TEST(Collectives, AllGatherConcatenatesInRankOrder, 1, 2, 3, 4) {
  const Group& group = world_group();
  for (auto dtype : kDtypes) {
    const int64_t n = 5;  // not a multiple of the world size
    at::Tensor input = contribution(group.rank(), n, dtype);
    at::Tensor output = torch::empty({group.size() * n}, dtype);
    all_gather(output, input, group).wait();
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < group.size(); ++r) parts.push_back(contribution(r, n, dtype));
    EXPECT_TRUE(torch::equal(output, torch::cat(parts))) << c10::toString(dtype);
  }
}

HP_DIST_TEST(Collectives, ReduceScatterSumAndAvg, 1, 2, 3, 4) {
  const Group& group = world_group();
  for (auto dtype : kDtypes) {
    const int64_t chunk = 3;
    const int64_t n = chunk * group.size();
    at::Tensor total = torch::zeros({n}, torch::kFloat);
    for (int64_t r = 0; r < group.size(); ++r) total += contribution(r, n, at::kFloat);
    at::Tensor mine = total.narrow(0, group.rank() * chunk, chunk);

    at::Tensor sum = torch::empty({chunk}, dtype);
    reduce_scatter(sum, contribution(group.rank(), n, dtype), ReduceOp::kSum, group).wait();
    EXPECT_TRUE(torch::equal(sum.to(at::kFloat), mine)) << c10::toString(dtype);

    // Gloo's own AVG returns the sum here; the mean differs from it for size > 1.
    at::Tensor avg = torch::empty({chunk}, dtype);
    reduce_scatter(avg, contribution(group.rank(), n, dtype), ReduceOp::kAvg, group).wait();
    at::Tensor expected = (mine / group.size()).to(dtype).to(at::kFloat);
    EXPECT_TRUE(torch::allclose(avg.to(at::kFloat), expected, 1e-2, 0)) << avg << expected;
  }
}

HP_DIST_TEST(Collectives, ReduceScatterMaxAndMin, 1, 2, 3, 4) {
  const Group& group = world_group();
  const int64_t chunk = 4;
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < group.size(); ++r) {
    all.push_back(contribution(r, chunk * group.size(), at::kFloat) * (r % 2 ? -1 : 1));
  }
  const at::Tensor stacked = torch::stack(all);
  const std::vector<std::pair<ReduceOp, at::Tensor>> cases = {
      {ReduceOp::kMax, std::get<0>(stacked.max(0))},
      {ReduceOp::kMin, std::get<0>(stacked.min(0))},
  };
  for (const auto& [op, full] : cases) {
    at::Tensor out = torch::empty({chunk});
    reduce_scatter(out, all[group.rank()], op, group).wait();
    EXPECT_TRUE(torch::equal(out, full.narrow(0, group.rank() * chunk, chunk))) << to_string(op);
  }
}

// bf16 partial sums are kept in fp32 and rounded once: 256 + 1 + 1 + 1 is 259 -> 260 in
// bf16, where adding in bf16 one rank after the other would stay at 256.
HP_DIST_TEST(Collectives, ReduceScatterRoundsBf16SumOnce, 4) {
  const Group& group = world_group();
  const int64_t chunk = 2;
  const float value = group.rank() == 0 ? 256.0f : 1.0f;
  at::Tensor input = torch::full({chunk * group.size()}, value, torch::kBFloat16);
  at::Tensor out = torch::empty({chunk}, torch::kBFloat16);
  reduce_scatter(out, input, ReduceOp::kSum, group).wait();
  EXPECT_TRUE(torch::equal(out.to(at::kFloat), torch::full({chunk}, 260.0f))) << out;
}

HP_DIST_TEST(Collectives, AllReduceOps, 1, 2, 3, 4) {
  const Group& group = world_group();
  for (auto dtype : kDtypes) {
    const int64_t n = 7;
    std::vector<at::Tensor> all;
    for (int64_t r = 0; r < group.size(); ++r) all.push_back(contribution(r, n, at::kFloat));
    at::Tensor stacked = torch::stack(all);
    const std::vector<std::pair<ReduceOp, at::Tensor>> cases = {
        {ReduceOp::kSum, stacked.sum(0)},
        {ReduceOp::kAvg, stacked.mean(0)},
        {ReduceOp::kMax, std::get<0>(stacked.max(0))},
        {ReduceOp::kMin, std::get<0>(stacked.min(0))},
    };
    for (const auto& [op, expected] : cases) {
      at::Tensor tensor = contribution(group.rank(), n, dtype);
      all_reduce(tensor, op, group).wait();
      EXPECT_TRUE(
          torch::allclose(tensor.to(at::kFloat), expected.to(dtype).to(at::kFloat), 1e-2, 0))
          << to_string(op) << " " << c10::toString(dtype) << tensor << expected;
    }
  }
}

HP_DIST_TEST(Collectives, AllToAllEqualAndUnequalSplits, 1, 2, 3, 4) {
  const Group& group = world_group();
  const int64_t w = group.size(), me = group.rank();
  for (auto dtype : kDtypes) {
    // Equal: row j of rank r's input (2 rows per peer) encodes (r, j).
    auto row_value = [](int64_t src, int64_t row) { return static_cast<float>(src * 10 + row); };
    at::Tensor input = torch::empty({2 * w, 3}, torch::kFloat);
    for (int64_t j = 0; j < 2 * w; ++j) input[j].fill_(row_value(me, j));
    at::Tensor output = torch::empty({2 * w, 3}, dtype);
    all_to_all(output, input.to(dtype), group).wait();
    for (int64_t src = 0; src < w; ++src) {
      for (int64_t k = 0; k < 2; ++k) {
        EXPECT_EQ(output[src * 2 + k][0].item<float>(), row_value(src, me * 2 + k));
      }
    }
    // Unequal: rank r sends (r + d + 1) rows to rank d.
    std::vector<int64_t> in_splits, out_splits;
    for (int64_t d = 0; d < w; ++d) in_splits.push_back(me + d + 1);
    for (int64_t s = 0; s < w; ++s) out_splits.push_back(s + me + 1);
    int64_t in_rows = 0, out_rows = 0;
    for (auto s : in_splits) in_rows += s;
    for (auto s : out_splits) out_rows += s;
    at::Tensor uneven_in = torch::empty({in_rows, 2}, torch::kFloat);
    for (int64_t d = 0, row = 0; d < w; ++d) {
      for (int64_t k = 0; k < in_splits[d]; ++k, ++row) uneven_in[row].fill_(me * 10 + d);
    }
    at::Tensor uneven_out = torch::empty({out_rows, 2}, dtype);
    all_to_all(uneven_out, uneven_in.to(dtype), group, out_splits, in_splits).wait();
    for (int64_t s = 0, row = 0; s < w; ++s) {
      for (int64_t k = 0; k < out_splits[s]; ++k, ++row) {
        EXPECT_EQ(uneven_out[row][1].item<float>(), static_cast<float>(s * 10 + me));
      }
    }
  }
}

HP_DIST_TEST(Collectives, BroadcastSendRecvBarrier, 1, 2, 3, 4) {
  const Group& group = world_group();
  const int64_t w = group.size(), me = group.rank();
  for (auto dtype : kDtypes) {
    const int64_t root = w - 1;
    at::Tensor tensor = contribution(me, 9, dtype);
    broadcast(tensor, root, group).wait();
    EXPECT_TRUE(torch::equal(tensor, contribution(root, 9, dtype)));
    if (w > 1) {  // ring: send to the right, receive from the left
      at::Tensor received = torch::empty({4}, dtype);
      CommHandle sent = send(contribution(me, 4, dtype), (me + 1) % w, group);
      recv(received, (me + w - 1) % w, group).wait();
      sent.wait();
      EXPECT_TRUE(torch::equal(received, contribution((me + w - 1) % w, 4, dtype)));
    }
  }
  barrier(group).wait();
}

// What a thread's collectives sent leaves out another thread's, which the process-wide
// count includes (an all-reduce sends 2 (n - 1) / n of its tensor: all of it on 2 ranks).
HP_DIST_TEST(Collectives, WireBytesOfAThreadLeaveOutOtherThreads, 2) {
  const GroupPtr elsewhere = testing::world()->new_group("other_thread", {0, 1});
  const int64_t mine_before = detail::wire_bytes_sent_by_this_thread();
  const int64_t all_before = wire_bytes().total();
  std::string failure;
  std::thread other([&] {
    try {
      at::Tensor t = torch::ones({1000});
      all_reduce(t, ReduceOp::kSum, *elsewhere).wait();
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    }
  });
  other.join();
  ASSERT_EQ(failure, "");
  EXPECT_EQ(detail::wire_bytes_sent_by_this_thread(), mine_before);
  EXPECT_EQ(wire_bytes().total() - all_before, 4000);
  at::Tensor t = torch::ones({10});
  all_reduce(t, ReduceOp::kSum, world_group()).wait();
  EXPECT_EQ(detail::wire_bytes_sent_by_this_thread() - mine_before, 40);
  EXPECT_EQ(wire_bytes().total() - all_before, 4040);
}

HP_DIST_TEST(Collectives, BadArgumentsAreExplained, 2) {
  const Group& group = world_group();
  const auto message = testing::error_of<c10::ValueError>;
  EXPECT_NE(message([&] {
              reduce_scatter(torch::empty({2}), torch::ones({5}), ReduceOp::kSum, group);
            }).find("pad the input"),
            std::string::npos);
  EXPECT_NE(message([&] {
              all_gather(torch::empty({3}), torch::ones({2}), group);
            }).find("all_gather: output must have"),
            std::string::npos);
  EXPECT_NE(message([&] { broadcast(torch::ones({2}), 5, group); }).find("outside group"),
            std::string::npos);
  EXPECT_NE(message([&] {
              all_reduce(torch::ones({2, 2}).t(), ReduceOp::kSum, group);
            }).find("contiguous"),
            std::string::npos);
  EXPECT_NE(message([] { parse_reduce_op("mean-ish"); }).find("use \"sum\""), std::string::npos);
  EXPECT_NE(message([&] {
              send(torch::ones({2}), group.rank(), group);
            }).find("send: a rank cannot send to itself"),
            std::string::npos);
  EXPECT_NE(message([&] {
              recv(torch::ones({2}), group.rank(), group);
            }).find("recv: a rank cannot receive from itself"),
            std::string::npos);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    EXPECT_EQ(parse_reduce_op(to_string(op)), op);
  }
  EXPECT_EQ(parse_reduce_op("Mean"), ReduceOp::kAvg);
  EXPECT_EQ(to_string(parse_reduce_op("MAX")), "max");
}

// Its own World (not the harness's, which the harness still uses after the body).
HP_DIST_TEST(World, ShutdownEndsItsGroupsAndNothingElse, 2) {
  std::shared_ptr<World> world = World::from_env();
  if (!torch::cuda::is_available()) EXPECT_EQ(world->device(), c10::Device(c10::kCPU));
  GroupPtr pair = world->new_group("pair", {0, 1});
  at::Tensor x = torch::ones({2});
  all_reduce(x, ReduceOp::kSum, *pair).wait();
  EXPECT_TRUE(torch::equal(x, torch::full({2}, 2.0f)));
  barrier(*world->world_group()).wait();

  world->shutdown();
  world->shutdown();  // a second call does nothing
  const auto error = testing::error_of<c10::Error>;
  EXPECT_NE(error([&] { all_reduce(x, ReduceOp::kSum, *pair).wait(); }).find("World::shutdown"),
            std::string::npos);
  EXPECT_NE(error([&] { barrier(*world->world_group()).wait(); }).find("was shut down"),
            std::string::npos);
  EXPECT_NE(error([&] { world->new_group("later", {0, 1}); }).find("was shut down"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(x, torch::full({2}, 2.0f)));  // the failed call left it alone
}

}  // namespace
}  // namespace hp
