#include "scaletrain/sampler.h"

#include <map>

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

std::vector<int64_t> all_ranks(int64_t n, int world, bool drop_last, bool shuffle, int64_t epoch) {
  std::vector<int64_t> out;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s({n, world, r, shuffle, 7, drop_last});
    s.set_epoch(epoch);
    auto idx = s.indices();
    EXPECT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
    out.insert(out.end(), idx.begin(), idx.end());
  }
  return out;
}

TEST(Sampler, UnshuffledSlicesAreStrided) {
  // PyTorch's layout: rank r takes positions r, r + world, ...; 10 samples on 3 ranks pad to 12
  // by repeating the first two.
  DistributedSampler r0({10, 3, 0, false, 0, false}), r2({10, 3, 2, false, 0, false});
  EXPECT_EQ(r0.indices(), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(r2.indices(), (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_FALSE(r2.is_padding(2));
  EXPECT_TRUE(r2.is_padding(3));
  EXPECT_FALSE(r0.is_padding(3));
}

TEST(Sampler, DropLastCutsTheTail) {
  DistributedSampler r1({10, 3, 1, false, 0, true});
  EXPECT_EQ(r1.indices(), (std::vector<int64_t>{1, 4, 7}));
}

TEST(Sampler, SlicesAreDisjointAndCoverTheDataSet) {
  for (int world : {1, 2, 3, 4, 7}) {
    auto all = all_ranks(103, world, false, true, 3);
    std::set<int64_t> distinct(all.begin(), all.end());
    EXPECT_EQ(distinct.size(), 103u) << world;  // every sample seen
    EXPECT_EQ(all.size() % static_cast<size_t>(world), 0u);
    auto cut = all_ranks(103, world, true, true, 3);
    std::set<int64_t> cut_distinct(cut.begin(), cut.end());
    EXPECT_EQ(cut_distinct.size(), cut.size()) << "drop_last never repeats";
  }
}

TEST(Sampler, ShuffleDependsOnSeedAndEpochOnly) {
  DistributedSampler a({50, 2, 0, true, 7, false}), b({50, 2, 0, true, 7, false});
  a.set_epoch(1);
  b.set_epoch(1);
  EXPECT_EQ(a.indices(), b.indices());
  b.set_epoch(2);
  EXPECT_NE(a.indices(), b.indices());
  DistributedSampler c({50, 2, 0, true, 8, false});
  c.set_epoch(1);
  EXPECT_NE(a.indices(), c.indices());
  auto p = a.permutation();
  std::sort(p.begin(), p.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(p[static_cast<size_t>(i)], i);
}

TEST(Sampler, ExactEvaluationCountsEverySampleOnce) {
  const int64_t n = 10;
  int64_t counted = 0;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s({n, 4, r, true, 1, false});
    for (int64_t i = 0; i < s.num_samples(); ++i) counted += s.is_padding(i) ? 0 : 1;
  }
  EXPECT_EQ(counted, n);
}

TEST(Sampler, ResumesMidEpoch) {
  DistributedSampler s({40, 2, 1, true, 3, false});
  s.set_epoch(4);
  auto all = s.indices();
  s.advance(7);
  SamplerState saved = s.state();
  DistributedSampler t({40, 2, 1, true, 3, false});
  t.load_state(saved);
  auto rest = t.remaining();
  ASSERT_EQ(rest.size(), all.size() - 7);
  EXPECT_TRUE(std::equal(rest.begin(), rest.end(), all.begin() + 7));
  t.set_epoch(5);
  EXPECT_EQ(t.state().position, 0);
}

TEST(Sampler, BadStateOrRankIsRejected) {
  EXPECT_THROW(DistributedSampler({10, 2, 2, true, 0, false}), UsageError);
  DistributedSampler s({10, 2, 0, true, 0, false});
  EXPECT_THROW(s.load_state({0, -2, 10}), UsageError);
  EXPECT_THROW(s.load_state({0, 4, 12}), UsageError);  // a state of another data set
}

// Regression (ResumeAtAnotherWorldSizeTrainsWrongSamples): the position was each rank's own
// count, so a state saved by 2 ranks and loaded by 1 skipped the other rank's samples, and the
// reverse trained samples twice. Every sample of the epoch must be consumed exactly once,
// whatever the world sizes before and after, padding aside.
void ExpectEachSampleOnce(int64_t n, int before, int after, int64_t steps_before, int64_t batch,
                          bool drop_last) {
  std::map<int64_t, int> seen;
  SamplerState saved;
  for (int r = 0; r < before; ++r) {
    DistributedSampler s({n, before, r, true, 5, drop_last});
    s.set_epoch(3);
    auto mine = s.indices();
    const int64_t take = std::min<int64_t>(steps_before * batch, s.num_samples());
    for (int64_t i = 0; i < take; ++i) ++seen[mine[static_cast<size_t>(i)]];
    s.advance(take);
    if (r == 0) saved = s.state();
  }
  int64_t padded = 0;
  for (int r = 0; r < after; ++r) {
    DistributedSampler s({n, after, r, true, 5, drop_last});
    s.load_state(saved);
    const auto rest = s.remaining();
    ASSERT_EQ(static_cast<int64_t>(rest.size()), s.num_samples());
    for (size_t i = 0; i < rest.size(); ++i) {
      if (s.is_padding(static_cast<int64_t>(i))) {
        ++padded;
      } else {
        ++seen[rest[i]];
      }
    }
  }
  const int64_t expected = drop_last ? n - n % after : n;
  int64_t distinct = 0;
  for (auto& [index, count] : seen) {
    EXPECT_EQ(count, 1) << "sample " << index << " of " << n << ", " << before << " -> " << after
                        << " ranks";
    ++distinct;
  }
  if (!drop_last) {
    EXPECT_EQ(distinct, n) << before << " -> " << after;
  }
  EXPECT_LE(distinct, expected + before);
  EXPECT_LT(padded, after);
}

TEST(Sampler, ResumeAtAnotherWorldSizeTrainsEachSampleOnce) {
  for (int before : {1, 2, 3, 4}) {
    for (int after : {1, 2, 3, 4}) {
      for (int64_t steps : {0, 1, 3}) {
        ExpectEachSampleOnce(48, before, after, steps, 4, false);
        ExpectEachSampleOnce(50, before, after, steps, 3, false);
      }
    }
  }
}

TEST(Sampler, GlobalPositionIsTheSameAtEveryRank) {
  DistributedSampler a({40, 4, 0, true, 1, false}), b({40, 4, 3, true, 1, false});
  a.advance(6);
  b.advance(6);
  EXPECT_EQ(a.state().position, 24);
  EXPECT_EQ(b.state().position, 24);
  EXPECT_EQ(a.state().dataset_size, 40);
  // Loaded at one rank, the rest of the epoch is the permutation from there on, in order.
  DistributedSampler one({40, 1, 0, true, 1, false});
  one.load_state(a.state());
  auto p = a.permutation();
  EXPECT_EQ(one.remaining(), std::vector<int64_t>(p.begin() + 24, p.end()));
  // A finished epoch (the padded tail consumed too) leaves nothing.
  DistributedSampler done({40, 3, 1, true, 1, false});
  done.load_state({0, 42, 40});
  EXPECT_TRUE(done.remaining().empty());
}

}  // namespace
}  // namespace scaletrain
