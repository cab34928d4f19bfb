#include "scaletrain/schedule.h"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

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
      if (c) (c->forward() ? forwards : backwards)++;
    }
  }
  EXPECT_EQ(forwards, 15);
  EXPECT_EQ(backwards, 15);
}

TEST(Schedule, InterleavedTwoDevicesTwoChunksTwoMicrobatches) {
  // Drawn by hand: stage k on device k % 2 as its chunk k / 2 ("F1.1": micro-batch 1 on chunk
  // 1). Device 0 warms up with 2(p-1-s) + (v-1)p = 4 forwards, device 1 with 2; each
  // micro-batch goes 0 -> 1 -> 0 -> 1 through the devices and back.
  EXPECT_EQ(draw(interleaved_schedule(2, 2, 2)),
            "s0 F0.0 F1.0 F0.1 F1.1 . B0.1 . B1.1 B0.0 B1.0\n"
            "s1 . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0 .\n");
}

TEST(Schedule, InterleavedBubbleMatchesTheory) {
  for (int p = 1; p <= 4; ++p) {
    for (int v = 1; v <= 3; ++v) {
      for (int m = p; m <= 4 * p; m += p) {
        auto t = interleaved_schedule(p, v, m);
        EXPECT_EQ(static_cast<int>(t.size()), 2 * (v * m + p - 1)) << p << " " << v << " " << m;
        EXPECT_DOUBLE_EQ(idle_fraction(t), interleaved_bubble_fraction(p, v, m))
            << p << " " << v << " " << m;
        EXPECT_LT(idle_fraction(t), bubble_fraction(p, m) + 1e-12);
      }
    }
  }
  // Not whole rounds (a short last batch): fill-drain over the chunks, every task once.
  for (auto [p, v, m] : std::vector<std::tuple<int, int, int>>{{2, 2, 3}, {3, 2, 4}, {2, 3, 1}}) {
    auto t = interleaved_schedule(p, v, m);
    int forwards = 0, backwards = 0;
    for (auto& row : t) {
      for (auto& c : row) {
        if (c) (c->forward() ? forwards : backwards)++;
      }
    }
    EXPECT_EQ(forwards, p * v * m) << p << " " << v << " " << m;
    EXPECT_EQ(backwards, p * v * m) << p << " " << v << " " << m;
  }
  EXPECT_THROW(interleaved_order(2, 0, 2), UsageError);
}

TEST(Schedule, ZeroBubbleTwoStagesThreeMicrobatches) {
  // Drawn by hand: I (input gradient) as soon as the next stage's is there, F within p in
  // flight, W (weight gradient) in what would be a bubble: 2 idle ticks of 11 per stage, where
  // 1F1B idles 2 of 8 ticks that are 1.5 times as long (a B is an I and a W).
  EXPECT_EQ(draw(zero_bubble_h1_schedule(2, 3)),
            "s0 F0 F1 . I0 W0 I1 F2 W1 . I2 W2\n"
            "s1 . F0 I0 F1 I1 W0 W1 F2 I2 W2 .\n");
}

TEST(Schedule, ZeroBubbleNearItsTheoryAtOneFOneBsMemory) {
  for (int p = 1; p <= 5; ++p) {
    for (int m = p; m <= 8 * p; ++m) {
      auto t = zero_bubble_h1_schedule(p, m);
      const int ideal = 3 * m + p - 1, len = static_cast<int>(t.size());
      if (m == p) {
        EXPECT_EQ(len, ideal) << p << " " << m;
        EXPECT_DOUBLE_EQ(idle_fraction(t), zero_bubble_h1_bubble_fraction(p, m)) << p << " " << m;
      }
      EXPECT_GE(len, ideal) << p << " " << m;
      EXPECT_LE(len, ideal + (p + 1) / 2) << p << " " << m;
      // Every stage runs F, I and W once per micro-batch, I before W, and holds at most p.
      for (int s = 0; s < p; ++s) {
        std::vector<int> f(static_cast<size_t>(m)), i(static_cast<size_t>(m)),
            w(static_cast<size_t>(m));
        for (int tick = 0; tick < len; ++tick) {
          const auto& c = t[static_cast<size_t>(tick)][static_cast<size_t>(s)];
          if (!c) continue;
          auto& slot = c->pass == Pass::kForward ? f : c->pass == Pass::kInputGrad ? i : w;
          ASSERT_NE(c->pass, Pass::kBackward);
          slot[static_cast<size_t>(c->microbatch)] = tick + 1;
        }
        for (int k = 0; k < m; ++k) {
          const auto u = static_cast<size_t>(k);
          EXPECT_TRUE(f[u] > 0 && f[u] < i[u] && i[u] < w[u]) << p << " " << m << " " << s;
        }
        EXPECT_LE(peak_in_flight(t, s), std::min(p, m));
      }
    }
  }
}

TEST(Schedule, DeadlockingOrderIsRefused) {
  // Stage 0 wants B0 before anything ran on stage 1.
  std::vector<std::vector<PipeTask>> bad = {{{0, Pass::kBackward}, {0, Pass::kForward}},
                                            {{0, Pass::kForward}, {0, Pass::kBackward}}};
  EXPECT_THROW(schedule(bad), Error);
  EXPECT_THROW(gpipe_schedule(0, 3), UsageError);
}

}  // namespace
}  // namespace scaletrain
