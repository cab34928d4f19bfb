#include "scaletrain/schedule.h"

#include <gtest/gtest.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

TEST(Schedule, GPipeTwoStagesThreeMicrobatches) {
  // Drawn by hand: all forwards fill the pipe, then backwards drain it in reverse.
  EXPECT_EQ(draw(gpipe_schedule(2, 3)),
            "s0 F0 F1 F2 . . B2 B1 B0\n"
            "s1 . F0 F1 F2 B2 B1 B0 .\n");
}

TEST(Schedule, OneFOneBTwoStagesThreeMicrobatches) {
  EXPECT_EQ(draw(one_f_one_b_schedule(2, 3)),
            "s0 F0 F1 . B0 F2 B1 . B2\n"
            "s1 . F0 B0 F1 B1 F2 B2 .\n");
}

TEST(Schedule, OneFOneBThreeStagesFourMicrobatches) {
  // Stage s warms up with p-1-s forwards, then alternates one forward, one backward.
  EXPECT_EQ(draw(one_f_one_b_schedule(3, 4)),
            "s0 F0 F1 F2 . . B0 F3 B1 . B2 . B3\n"
            "s1 . F0 F1 . B0 F2 B1 F3 B2 . B3 .\n"
            "s2 . . F0 B0 F1 B1 F2 B2 F3 B3 . .\n");
}

TEST(Schedule, GPipeLengthAndBubbleMatchTheory) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      auto t = gpipe_schedule(p, m);
      EXPECT_EQ(static_cast<int>(t.size()), 2 * (m + p - 1)) << p << " " << m;
      // Both are one correctly rounded division of small integers with the same ratio: the
      // same double.
      EXPECT_EQ(idle_fraction(t), bubble_fraction(p, m)) << p << " " << m;
      for (int s = 0; s < p; ++s) EXPECT_EQ(peak_in_flight(t, s), m);
    }
  }
}

TEST(Schedule, OneFOneBIsAsShortAndHoldsFewerActivations) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      auto t = one_f_one_b_schedule(p, m);
      EXPECT_EQ(static_cast<int>(t.size()), 2 * (m + p - 1)) << p << " " << m;
      for (int s = 0; s < p; ++s) EXPECT_EQ(peak_in_flight(t, s), std::min(p - s, m)) << s;
    }
  }
}

TEST(Schedule, EveryTaskRunsOnce) {
  auto t = one_f_one_b_schedule(3, 5);
  int forwards = 0, backwards = 0;
  for (auto& row : t) {
    for (auto& c : row) {
      if (c) (c->forward ? forwards : backwards)++;
    }
  }
  EXPECT_EQ(forwards, 15);
  EXPECT_EQ(backwards, 15);
}

TEST(Schedule, DeadlockingOrderIsRefused) {
  // Stage 0 wants B0 before anything ran on stage 1.
  std::vector<std::vector<PipeTask>> bad = {{{0, false}, {0, true}}, {{0, true}, {0, false}}};
  EXPECT_THROW(schedule(bad), Error);
  EXPECT_THROW(gpipe_schedule(0, 3), UsageError);
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
