// Device mesh: group membership of every rank for 2-D and 3-D meshes, flattened groups,
// slicing, and a clear error for each bad configuration.
#include <torch/torch.h>

#include "distributed_test.h"
#include "error_of.h"
#include "hyperparallel/collectives.h"
#include "hyperparallel/mesh.h"

namespace hp {
namespace {

const auto error_of = testing::error_of<c10::ValueError>;

// The group really connects the listed ranks: all-gathering global ranks returns them.
void expect_group_connects(const Group& group) {
  at::Tensor mine = torch::full({1}, static_cast<float>(testing::world()->rank()));
  at::Tensor all = torch::empty({group.size()});
  all_gather(all, mine, group).wait();
  for (int64_t i = 0; i < group.size(); ++i) {
    EXPECT_EQ(all[i].item<float>(), static_cast<float>(group.ranks()[i])) << group.name();
  }
}

HP_DIST_TEST(DeviceMesh, TwoDimensionalGroups, 4) {
  DeviceMesh mesh(testing::world(), {{"dp_replicate", 2}, {"dp_shard", 2}});
  const int64_t r = mesh.global_rank();
  EXPECT_EQ(mesh.coordinate("dp_replicate"), r / 2);
  EXPECT_EQ(mesh.coordinate("dp_shard"), r % 2);
  // Row-major: shard groups are {0,1},{2,3}; replicate groups are {0,2},{1,3}.
  EXPECT_EQ(mesh.group_ranks("dp_shard"), (std::vector<int64_t>{r / 2 * 2, r / 2 * 2 + 1}));
  EXPECT_EQ(mesh.group_ranks("dp_replicate"), (std::vector<int64_t>{r % 2, r % 2 + 2}));
  EXPECT_EQ(mesh.group("dp_shard")->rank(), r % 2);
  const GroupPtr& dp = mesh.flatten({"dp_replicate", "dp_shard"}, "dp");
  EXPECT_EQ(dp->ranks(), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(dp->rank(), r);
  for (const auto* name : {"dp_replicate", "dp_shard", "dp"}) {
    expect_group_connects(*mesh.group(name));
  }
  DeviceMesh shard = mesh.slice({"dp_shard"});
  EXPECT_EQ(shard.ndim(), 1);
  EXPECT_EQ(shard.size(), 2);
  EXPECT_EQ(shard.group("dp_shard").get(), mesh.group("dp_shard").get())
      << "a slice shares the parent's groups";
  EXPECT_NE(error_of([&] { shard.group("dp"); }).find("no dimension or flattened group 'dp'"),
            std::string::npos)
      << "a flattened group spanning dims outside the slice is not part of the slice";
}

HP_DIST_TEST(DeviceMesh, ThreeDimensionalGroups, 8) {
  DeviceMesh mesh(testing::world(), {{"pp", 2}, {"dp", 2}, {"tp", 2}});
  const int64_t r = mesh.global_rank();
  const int64_t pp = r / 4, dp = (r / 2) % 2, tp = r % 2;
  EXPECT_EQ(mesh.coordinate("pp"), pp);
  EXPECT_EQ(mesh.coordinate("dp"), dp);
  EXPECT_EQ(mesh.coordinate("tp"), tp);
  EXPECT_EQ(mesh.group_ranks("pp"), (std::vector<int64_t>{dp * 2 + tp, 4 + dp * 2 + tp}));
  EXPECT_EQ(mesh.group_ranks("dp"), (std::vector<int64_t>{pp * 4 + tp, pp * 4 + 2 + tp}));
  EXPECT_EQ(mesh.group_ranks("tp"), (std::vector<int64_t>{pp * 4 + dp * 2, pp * 4 + dp * 2 + 1}));
  mesh.flatten({"tp", "pp"}, "pp_tp");  // listed out of order: kept in mesh order
  EXPECT_EQ(mesh.group_ranks("pp_tp"),
            (std::vector<int64_t>{dp * 2, dp * 2 + 1, 4 + dp * 2, 4 + dp * 2 + 1}));
  for (const auto* name : {"pp", "dp", "tp", "pp_tp"}) expect_group_connects(*mesh.group(name));
  DeviceMesh sub = mesh.slice({"tp", "dp"});
  EXPECT_EQ(sub.dim_names(), (std::vector<std::string>{"dp", "tp"}));
  EXPECT_EQ(sub.size(), 4);
  EXPECT_EQ(sub.coordinate("tp"), tp);
  EXPECT_NE(error_of([&] { sub.size("pp"); }).find("mesh has no dimension 'pp' (it has: dp, tp)"),
            std::string::npos);
}

// A flattened group as a dimension of a sub-mesh (torchtitan's dp_shard x cp shard group).
HP_DIST_TEST(DeviceMesh, FlattenedGroupsAreDimensionsOfSlices, 8) {
  DeviceMesh mesh(testing::world(), {{"dp_shard", 2}, {"cp", 2}, {"tp", 2}});
  const int64_t r = mesh.global_rank();
  const GroupPtr& dp_cp = mesh.flatten({"dp_shard", "cp"}, "dp_shard_cp");
  DeviceMesh shard = mesh.slice({"dp_shard_cp"});
  EXPECT_EQ(shard.ndim(), 1);
  EXPECT_EQ(shard.dim_names(), (std::vector<std::string>{"dp_shard_cp"}));
  EXPECT_EQ(shard.size(), 4);
  EXPECT_EQ(shard.size("dp_shard_cp"), 4);
  EXPECT_EQ(shard.group("dp_shard_cp").get(), dp_cp.get());
  EXPECT_EQ(shard.coordinate("dp_shard_cp"), dp_cp->rank());
  EXPECT_EQ(shard.group_ranks("dp_shard_cp"),
            (std::vector<int64_t>{r % 2, r % 2 + 2, r % 2 + 4, r % 2 + 6}));
  EXPECT_TRUE(shard.has_group("cp")) << "its dims' own groups belong to it";
  EXPECT_FALSE(shard.has_group("tp"));
  // 2-D: the flattened dim and tp, listed out of order, kept in mesh order.
  DeviceMesh two = mesh.slice({"tp", "dp_shard_cp"});
  EXPECT_EQ(two.dim_names(), (std::vector<std::string>{"dp_shard_cp", "tp"}));
  EXPECT_EQ(two.size(), 8);
  const GroupPtr& all = two.flatten({"dp_shard_cp", "tp"}, "all");
  EXPECT_EQ(all->size(), 8);
  EXPECT_EQ(all->rank(), r);
  for (const auto* name : {"dp_shard_cp", "all"}) expect_group_connects(*two.group(name));
  EXPECT_NE(error_of([&] { mesh.slice({"cp", "dp_shard_cp"}); }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { mesh.flatten({"dp_shard_cp", "dp_shard"}, "bad"); }).find("listed twice"),
      std::string::npos);
}

HP_DIST_TEST(DeviceMesh, BadConfigurationsAreExplained, 4) {
  auto world = testing::world();
  EXPECT_NE(error_of([&] {
              DeviceMesh(world, {{"a", 2}, {"b", 3}});
            }).find("has 6 ranks but the world has 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh(world, {{"a", 2}, {"a", 2}}); }).find("appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh(world, {{"", 4}}); }).find("must not be empty"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh(world, {{"a", -2}, {"b", -2}}); }).find("must be positive"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh(world, {}); }).find("at least one dimension"),
            std::string::npos);
  DeviceMesh mesh(world, {{"x", 2}, {"y", 2}});
  EXPECT_NE(error_of([&] { mesh.coordinate("z"); }).find("no dimension 'z' (it has: x, y)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mesh.flatten({"x", "x"}, "xx"); }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mesh.flatten({"x"}, "y"); }).find("already used"), std::string::npos);
  EXPECT_NE(error_of([&] { mesh.slice({"q"}); }).find("no dimension 'q'"), std::string::npos);
}

}  // namespace
}  // namespace hp
