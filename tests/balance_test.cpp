// Balancing (balance.h): device_map="auto"-style placement and the cost split, against cases
// solved by hand.

#include "scaletrain/balance.h"

#include <gtest/gtest.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

TEST(Placement, FillsEachDeviceBeforeTheNext) {
  auto p = place_layers({4, 4, 4, 4, 4}, {{"cuda:0", 10}, {"cuda:1", 10}, {"cpu", 100}});
  EXPECT_EQ(p.balance, (std::vector<int>{2, 2, 1}));
  EXPECT_EQ(p.devices, (std::vector<std::string>{"cuda:0", "cuda:1", "cpu"}));
  EXPECT_EQ(p.stage_bytes, (std::vector<int64_t>{8, 8, 4}));
  EXPECT_EQ(p.layer_device[4], "cpu");
}

TEST(Placement, GpusComeBeforeTheCpuWhateverTheOrder) {
  auto p = place_layers({3, 3, 3}, {{"cpu", 100}, {"cuda:0", 6}});
  EXPECT_EQ(p.devices, (std::vector<std::string>{"cuda:0", "cpu"}));
  EXPECT_EQ(p.balance, (std::vector<int>{2, 1}));
}

TEST(Placement, ADeviceTooSmallForTheNextLayerIsSkipped) {
  auto p = place_layers({6, 6, 1}, {{"cuda:0", 5}, {"cuda:1", 7}, {"cpu", 100}});
  // Nothing fits on cuda:0; cuda:1 takes layer 0 (6 of 7); layer 1 moves on to the CPU, and the
  // layers after it stay there (order is kept: no going back to cuda:1).
  EXPECT_EQ(p.devices, (std::vector<std::string>{"cuda:1", "cpu"}));
  EXPECT_EQ(p.balance, (std::vector<int>{1, 2}));
}

TEST(Placement, ARepeatedDeviceMakesTwoStages) {
  auto p = place_layers({2, 2, 2, 2}, {{"cpu", 4}, {"cpu", 4}});
  EXPECT_EQ(p.devices, (std::vector<std::string>{"cpu", "cpu"}));
  EXPECT_EQ(p.balance, (std::vector<int>{2, 2}));
  EXPECT_EQ(p.report(), "cpu: layers 0-1, 4 B\ncpu: layers 2-3, 4 B\n");
}

TEST(Placement, ALayerThatFitsNowhereIsNamed) {
  try {
    place_layers({1, 50, 1}, {{"cuda:0", 10}, {"cpu", 40}});
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1 (50 B)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(place_layers({1}, {}), UsageError);
  EXPECT_THROW(place_layers({-1}, {{"cpu", 10}}), UsageError);
}

TEST(Placement, ReportShowsSizes) {
  auto p =
      place_layers({3 << 20, int64_t{3} << 30}, {{"cuda:0", 4 << 20}, {"cpu", int64_t{8} << 30}});
  EXPECT_EQ(p.report(), "cuda:0: layer 0, 3.0 MiB\ncpu: layer 1, 3.0 GiB\n");
}

TEST(Balance, HandSolvedCases) {
  EXPECT_EQ(balance_by_cost({1, 1, 1, 1}, 2), (std::vector<int>{2, 2}));
  EXPECT_EQ(balance_by_cost({4, 1, 1, 1, 1}, 2), (std::vector<int>{1, 4}));
  // {1,2,3 | 4,5 | 6}: slowest 9; every other split has a stage of 10 or more.
  EXPECT_EQ(balance_by_cost({1, 2, 3, 4, 5, 6}, 3), (std::vector<int>{3, 2, 1}));
  // One stage per layer when stages == layers.
  EXPECT_EQ(balance_by_cost({5, 1, 7}, 3), (std::vector<int>{1, 1, 1}));
  // Ties: {1,1 | 1} and {1 | 1,1} are both 2; earlier stages fullest.
  EXPECT_EQ(balance_by_cost({1, 1, 1}, 2), (std::vector<int>{2, 1}));
  EXPECT_THROW(balance_by_cost({1, 2}, 3), UsageError);
}

}  // namespace
}  // namespace scaletrain
