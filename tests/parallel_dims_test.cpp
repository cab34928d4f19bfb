// ParallelDims against tables written by hand: the degrees a world resolves to, the mesh they
// lay out (each rank's coordinates), what they read as, and the errors for degrees that do not
// make the world.
#include "scaletrain/parallel_dims.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

// Degrees in the order of the fields: {dp_replicate, dp_shard, zero_stage, pp, tp, cp, ep}.
using Dims = ParallelDims;

std::string error_of(const ParallelDims& d, int world) {
  try {
    d.resolve(world);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelDims, ResolveFillsInTheRestOfTheWorld) {
  struct Row {
    ParallelDims given;
    int world;
    ParallelDims resolved;
    int dp, model_ranks;
  };
  const std::vector<Row> table{
      // ddp at 4: four replicas
      {Dims({-1, 1, 0, 1, 1}), 4, Dims({4, 1, 0, 1, 1}), 4, 1},
      // ddp x tp 2 at 8: four replicas of a 2-rank model
      {Dims({-1, 1, 0, 1, 2}), 8, Dims({4, 1, 0, 1, 2}), 4, 2},
      // zero1 x tp 2 at 4: two shards
      {Dims({1, -1, 1, 1, 2}), 4, Dims({1, 2, 1, 1, 2}), 2, 2},
      // fsdp at 3: three shards
      {Dims({1, -1, 3, 1, 1}), 3, Dims({1, 3, 3, 1, 1}), 3, 1},
      // grid: 2 replicas x 2 stages x tp 2 = 8
      {Dims({-1, 1, 0, 2, 2}), 8, Dims({2, 1, 0, 2, 2}), 2, 4},
      // grid of one pipeline of 4 stages
      {Dims({-1, 1, 0, 4, 1}), 4, Dims({1, 1, 0, 4, 1}), 1, 4},
      // tp the rest: 2 replicas, tp 3 at 6
      {Dims({2, 1, 0, 1, -1}), 6, Dims({2, 1, 0, 1, 3}), 2, 3},
      // all given
      {Dims({2, 1, 0, 3, 1}), 6, Dims({2, 1, 0, 3, 1}), 2, 3},
      // one process
      {Dims({1, 1, 0, 1, 1}), 1, Dims({1, 1, 0, 1, 1}), 1, 1},
      // zero2 at world 1: a stage, nothing to shard over
      {Dims({1, -1, 2, 1, 1}), 1, Dims({1, 1, 2, 1, 1}), 1, 1},
      // ddp x cp 2 at 4: two replicas, each sequence over 2 ranks
      {Dims({-1, 1, 0, 1, 1, 2}), 4, Dims({2, 1, 0, 1, 1, 2}), 2, 1},
      // fsdp x cp 2 x tp 2 at 8: two shards
      {Dims({1, -1, 3, 1, 2, 2}), 8, Dims({1, 2, 3, 1, 2, 2}), 2, 2},
      // cp the rest: one replica, cp 4 at 4
      {Dims({1, 1, 0, 1, 1, -1}), 4, Dims({1, 1, 0, 1, 1, 4}), 1, 1},
  };
  for (const auto& row : table) {
    const auto r = row.given.resolve(row.world);
    EXPECT_EQ(r, row.resolved) << row.given.describe() << " at " << row.world << ": "
                               << r.describe();
    EXPECT_EQ(r.dp(), row.dp) << r.describe();
    EXPECT_EQ(r.model_ranks(), row.model_ranks) << r.describe();
    EXPECT_EQ(r.world(), row.world) << r.describe();
    EXPECT_EQ(r.dp_cp(), row.dp * r.cp) << r.describe();
    EXPECT_EQ(r.resolve(row.world), r) << "resolving twice changes nothing";
  }
}

TEST(ParallelDims, DescribeNamesEachDegreeAboveOne) {
  EXPECT_EQ(Dims({4, 1, 0, 1, 1}).describe(), "dp 4");
  EXPECT_EQ(Dims({1, 1, 0, 1, 1}).describe(), "dp 1");
  EXPECT_EQ(Dims({1, 4, 1, 2, 2}).describe(), "dp 4 (zero1) x pp 2 x tp 2");
  EXPECT_EQ(Dims({1, 2, 3, 1, 2}).describe(), "dp 2 (fsdp) x tp 2");
  EXPECT_EQ(Dims({-1, 1, 0, 2, 1}).describe(), "dp rest x pp 2");
  EXPECT_EQ(Dims({1, 1, 0, 2, 2}).describe(), "pp 2 x tp 2");
  EXPECT_EQ(Dims({1, 1, 2, 1, 1}).describe(), "dp 1 (zero2)");
  EXPECT_EQ(Dims({2, 1, 0, 1, 2, 2}).describe(), "dp 2 x cp 2 x tp 2");
  EXPECT_EQ(Dims({1, 1, 0, 1, 1, 4}).describe(), "cp 4");
}

// The mesh {dp, pp, tp}: tp innermost, so a tensor-parallel group is consecutive ranks (the
// grid's layout since it had tp); dp_replicate and dp_shard are one "dp" dimension.
TEST(ParallelDims, MeshLaysRanksOutDpPpTp) {
  const auto m = Dims({2, 1, 0, 2, 2}).mesh();
  EXPECT_EQ(m.describe(), "dp=2 x pp=2 x tp=2");
  // rank: dp, pp, tp
  const std::vector<std::vector<int>> coordinates{{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},
                                                  {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}};
  for (int r = 0; r < 8; ++r) EXPECT_EQ(m.coordinates(r), coordinates[r]) << "rank " << r;
  EXPECT_EQ(m.group(5, "dp"), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group(5, "pp"), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group(5, "tp"), (std::vector<int>{4, 5}));

  const auto sharded = Dims({1, 3, 1, 1, 2}).mesh({"dp", "tp"});
  EXPECT_EQ(sharded.describe(), "dp=3 x tp=2");
  EXPECT_EQ(sharded.group(3, "dp"), (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(sharded.group(3, "tp"), (std::vector<int>{2, 3}));
  // The order is the mesh's, whatever the order of the names.
  EXPECT_EQ(Dims({1, 3, 1, 1, 2}).mesh({"tp", "dp"}).describe(), "dp=3 x tp=2");
  EXPECT_EQ(Dims({1, 1, 0, 1, 1}).mesh({}).describe(), "dp=1");
}

// The mesh {dp, cp, pp, tp}: cp right after dp, so that dp x cp flattened (the ranks that
// average a gradient) is the "dp" of a mesh {dp · cp, pp, tp} with every rank in its place.
TEST(ParallelDims, MeshLaysContextParallelAfterDp) {
  const auto m = Dims({1, 1, 0, 2, 1, 2}).mesh({"dp", "cp", "pp", "tp"});  // pp 2 x cp 2
  EXPECT_EQ(m.describe(), "dp=1 x cp=2 x pp=2 x tp=1");
  // rank: dp, cp, pp, tp
  const std::vector<std::vector<int>> coordinates{
      {0, 0, 0, 0}, {0, 0, 1, 0}, {0, 1, 0, 0}, {0, 1, 1, 0}};
  for (int r = 0; r < 4; ++r) EXPECT_EQ(m.coordinates(r), coordinates[r]) << "rank " << r;
  EXPECT_EQ(m.group(1, "cp"), (std::vector<int>{1, 3}));
  EXPECT_EQ(m.group(1, "pp"), (std::vector<int>{0, 1}));
  const DeviceMesh flat({{"dp", 2}, {"pp", 2}, {"tp", 1}}, 4);  // dp x cp flattened
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(flat.coordinate(r, "dp"), m.coordinate(r, "cp")) << "rank " << r;
    EXPECT_EQ(flat.coordinate(r, "pp"), m.coordinate(r, "pp")) << "rank " << r;
  }
  const auto with_tp = Dims({2, 1, 0, 1, 2, 2}).mesh({"dp", "cp", "tp"});
  EXPECT_EQ(with_tp.describe(), "dp=2 x cp=2 x tp=2");
  EXPECT_EQ(with_tp.group(5, "cp"), (std::vector<int>{5, 7}));
  EXPECT_EQ(with_tp.group(5, "tp"), (std::vector<int>{4, 5}));
  EXPECT_EQ(with_tp.group(6, "cp"), (std::vector<int>{4, 6}));
}

TEST(ParallelDims, MeshRefusesALeftOutDegreeAboveOneAnUnknownNameAndTheUnresolved) {
  auto message = [](const ParallelDims& d, const std::vector<std::string>& names) {
    try {
      d.mesh(names);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message(Dims({2, 1, 0, 2, 1}), {"dp", "tp"}),
            "a mesh without dimension 'pp' from dp 2 x pp 2: its degree is 2, not 1");
  EXPECT_EQ(message(Dims({2, 1, 0, 1, 1}), {"dp", "ep"}),
            "ParallelDims has no mesh dimension 'ep': dp, pp, cp or tp");
  EXPECT_EQ(message(Dims({2, 1, 0, 1, 1, 2}), {"dp", "tp"}),
            "a mesh without dimension 'cp' from dp 2 x cp 2: its degree is 2, not 1");
  EXPECT_EQ(message(Dims({-1, 1, 0, 1, 2}), {"dp", "tp"}),
            "ParallelDims dp rest x tp 2 is not resolved (ParallelDims::dp_replicate -1): call "
            "resolve(world) first");
}

TEST(ParallelDims, ResolveRefusesDegreesThatDoNotMakeTheWorld) {
  EXPECT_EQ(error_of(Dims({-1, 1, 0, 2, 2}), 6),
            "the world of 6 ranks does not divide by dp rest x pp 2 x tp 2 (4 ranks a "
            "dp_replicate coordinate): give a world that is a multiple of 4");
  EXPECT_EQ(error_of(Dims({2, 1, 0, 2, 1}), 6),
            "dp 2 x pp 2 makes 4 ranks, and the world has 6: make the degrees' product the world "
            "size (or one degree -1, the rest)");
  EXPECT_EQ(error_of(Dims({-1, 1, 0, -1, 1}), 4),
            "ParallelDims::dp_replicate and ParallelDims::pp are both -1 (the rest of the world): "
            "give one of them a degree");
  EXPECT_EQ(error_of(Dims({1, 1, 0, 1, 0}), 4),
            "ParallelDims::tp 0: a degree is at least 1 (or -1: the rest of the world)");
  EXPECT_EQ(error_of(Dims({1, 1, 0, -2, 1}), 4),
            "ParallelDims::pp -2: a degree is at least 1 (or -1: the rest of the world)");
  EXPECT_EQ(error_of(Dims({1, 1, 0, 1, 1}), 0), "a world of 0 ranks: it needs at least 1");
  EXPECT_EQ(error_of(Dims({-1, 1, 0, 1, 2, 2}), 6),
            "the world of 6 ranks does not divide by dp rest x cp 2 x tp 2 (4 ranks a "
            "dp_replicate coordinate): give a world that is a multiple of 4");
  EXPECT_EQ(error_of(Dims({1, 1, 0, 1, 1, 0}), 2),
            "ParallelDims::cp 0: a degree is at least 1 (or -1: the rest of the world)");
  EXPECT_EQ(error_of(Dims({1, 2, 4, 1, 1}), 2),
            "ParallelDims::zero_stage 4 is not a ZeRO stage: give 0 (none), 1, 2 or 3 (fsdp)");
  EXPECT_EQ(error_of(Dims({1, 2, 0, 1, 1}), 2),
            "ParallelDims::dp_shard 2 shards nothing with ParallelDims::zero_stage 0: give a stage "
            "of 1, 2 or 3, or replicate with ParallelDims::dp_replicate");
  EXPECT_EQ(error_of(Dims({2, 2, 1, 1, 1}), 4),
            "ParallelDims::dp_replicate 2 with dp_shard 2 (a hybrid of replicas and shards) is not "
            "supported yet: shard over the whole data-parallel dimension (dp_replicate 1, dp_shard "
            "-1)");
}

// ep borrows its ranks from dp x cp: no factor of the world, a divisor of dp x cp.
TEST(ParallelDims, ExpertParallelDividesDpTimesCp) {
  const auto r = Dims({-1, 1, 0, 1, 1, 2, 4}).resolve(8);  // dp 4 x cp 2, ep 4
  EXPECT_EQ(r.world(), 8);
  EXPECT_EQ(r.dp(), 4);
  EXPECT_EQ(r.describe(), "dp 4 x cp 2 (ep 4)");
  EXPECT_EQ(Dims({-1, 1, 0, 1, 2, 1, 2}).resolve(8).describe(), "dp 4 x tp 2 (ep 2)");
  EXPECT_EQ(error_of(Dims({-1, 1, 0, 1, 2, 1, 3}), 8),
            "ParallelDims::ep 3: the expert-parallel degree is at least 1 and divides dp x cp (4 "
            "ranks here, dp 4 x tp 2 (ep 3)); give an ep degree that divides it");
  EXPECT_NE(error_of(Dims({-1, 1, 0, 1, 1, 1, 0}), 2).find("ParallelDims::ep 0"),
            std::string::npos);
  EXPECT_NE(Dims({2, 1, 0, 1, 1, 1, 2}), Dims({2, 1, 0, 1, 1, 1, 1}));
}

}  // namespace
}  // namespace scaletrain
