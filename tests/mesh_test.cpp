// DeviceMesh against tables written by hand.

#include "scaletrain/mesh.h"

#include <gtest/gtest.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(DeviceMesh, TwoByTwo) {
  DeviceMesh m({{"dp", 2}, {"pp", 2}}, 4);
  //          pp 0  pp 1
  //   dp 0     0     1
  //   dp 1     2     3
  const std::vector<std::vector<int>> coords = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m.coordinates(r), coords[static_cast<size_t>(r)]) << r;
    EXPECT_EQ(m.rank_at(coords[static_cast<size_t>(r)]), r);
  }
  EXPECT_EQ(m.groups("dp"), (Groups{{0, 2}, {1, 3}}));
  EXPECT_EQ(m.groups("pp"), (Groups{{0, 1}, {2, 3}}));
  EXPECT_EQ(m.group(3, "dp"), (std::vector<int>{1, 3}));
  EXPECT_EQ(m.group(3, "pp"), (std::vector<int>{2, 3}));
  EXPECT_EQ(m.coordinate(2, "dp"), 1);
  EXPECT_EQ(m.coordinate(2, "pp"), 0);
  EXPECT_EQ(m.describe(), "dp=2 x pp=2");
}

TEST(DeviceMesh, TwoByThree) {
  DeviceMesh m({{"dp", 2}, {"tp", 3}}, 6);
  //          tp 0  tp 1  tp 2
  //   dp 0     0     1     2
  //   dp 1     3     4     5
  const std::vector<std::vector<int>> coords = {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}};
  for (int r = 0; r < 6; ++r) EXPECT_EQ(m.coordinates(r), coords[static_cast<size_t>(r)]) << r;
  EXPECT_EQ(m.groups("dp"), (Groups{{0, 3}, {1, 4}, {2, 5}}));
  EXPECT_EQ(m.groups("tp"), (Groups{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(m.group(4, "dp"), (std::vector<int>{1, 4}));
  EXPECT_EQ(m.group(4, "tp"), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(m.size("tp"), 3);
}

TEST(DeviceMesh, OneByFour) {
  DeviceMesh m({{"dp", 1}, {"pp", 4}}, 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(m.coordinates(r), (std::vector<int>{0, r}));
  EXPECT_EQ(m.groups("dp"), (Groups{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(m.groups("pp"), (Groups{{0, 1, 2, 3}}));
}

TEST(DeviceMesh, ThreeDimensions) {
  DeviceMesh m({{"dp", 2}, {"pp", 2}, {"tp", 2}}, 8);
  EXPECT_EQ(m.coordinates(5), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(m.group(5, "dp"), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group(5, "pp"), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group(5, "tp"), (std::vector<int>{4, 5}));
  // Every rank is in exactly one group of each dimension.
  for (const auto& dim : {"dp", "pp", "tp"}) {
    std::vector<int> seen(8, 0);
    for (const auto& g : m.groups(dim)) {
      for (int r : g) ++seen[static_cast<size_t>(r)];
    }
    EXPECT_EQ(seen, std::vector<int>(8, 1)) << dim;
  }
}

TEST(DeviceMesh, BadMeshesAreRefusedNamingTheFix) {
  auto message = [](const std::vector<MeshDim>& dims, int world) {
    try {
      DeviceMesh m(dims, world);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message({{"dp", 2}, {"pp", 2}}, 6).find("has 4 ranks, and the world has 6"),
            std::string::npos);
  EXPECT_NE(message({{"dp", 2}, {"dp", 3}}, 6).find("names dimension 'dp' twice"),
            std::string::npos);
  EXPECT_NE(message({{"dp", 0}}, 0).find("has size 0"), std::string::npos);
  EXPECT_NE(message({}, 1).find("at least one dimension"), std::string::npos);
  DeviceMesh m({{"dp", 2}}, 2);
  EXPECT_THROW(m.size("tp"), UsageError);
  EXPECT_THROW(m.coordinates(2), UsageError);
  EXPECT_THROW(m.rank_at({2}), UsageError);
}

}  // namespace
}  // namespace scaletrain
