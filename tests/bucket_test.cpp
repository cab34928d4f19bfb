#include "scaletrain/bucket.h"

#include <gtest/gtest.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Buckets = std::vector<std::vector<size_t>>;
constexpr int64_t MB = 1 << 20;

std::vector<BucketParam> sizes(std::initializer_list<int64_t> bytes, const std::string& g = "f32") {
  std::vector<BucketParam> out;
  for (auto b : bytes) out.push_back({b, g});
  return out;
}

TEST(Buckets, ReverseOrderFirstCapThenBigCap) {
  // params:    0     1     2     3     4      (registration order)
  // MB:        4     4     4    0.5   0.6
  // reverse:   4: 0.6 -> open; 3: 1.1 >= 1 -> close [4,3] (first cap 1 MB)
  //            2: 4; 1: 8; 0: 12 -> under 25 MB, closes at the end: [2,1,0]
  auto b = assign_buckets(sizes({4 * MB, 4 * MB, 4 * MB, MB / 2, MB * 6 / 10}));
  EXPECT_EQ(b, (Buckets{{4, 3}, {2, 1, 0}}));
}

TEST(Buckets, TheParameterThatCrossesTheCapIsIncluded) {
  BucketOptions o{10, 20};
  // reverse: 3 (6), 2 (6 -> 12 >= 10 close [3,2]); 1 (15), 0 (15 -> 30 >= 20 close [1,0])
  EXPECT_EQ(assign_buckets(sizes({15, 15, 6, 6}), o), (Buckets{{3, 2}, {1, 0}}));
}

TEST(Buckets, OneHugeParameterIsABucketOfItsOwn) {
  BucketOptions o{10, 20};
  EXPECT_EQ(assign_buckets(sizes({5, 100, 5}), o), (Buckets{{2, 1}, {0}}));
}

TEST(Buckets, GroupsNeverShareABucket) {
  BucketOptions o{100, 100};
  std::vector<BucketParam> p = {{10, "f32@cpu"}, {10, "f16@cpu"}, {10, "f32@cpu"}, {10, "f16@cpu"}};
  // Nothing reaches a cap: each group closes at the end, in the order groups first appeared
  // (reverse order: f16 first).
  EXPECT_EQ(assign_buckets(p, o), (Buckets{{3, 1}, {2, 0}}));
}

TEST(Buckets, EmptyAndSingle) {
  EXPECT_TRUE(assign_buckets({}).empty());
  EXPECT_EQ(assign_buckets(sizes({4})), (Buckets{{0}}));
}

TEST(Buckets, EveryIndexExactlyOnce) {
  std::vector<BucketParam> p;
  for (int i = 0; i < 200; ++i) p.push_back({(i * 7919) % 3000000 + 1, i % 3 ? "a" : "b"});
  auto b = assign_buckets(p);
  std::vector<int> seen(p.size(), 0);
  for (auto& bucket : b) {
    for (size_t i : bucket) ++seen[i];
  }
  for (int s : seen) EXPECT_EQ(s, 1);
}

TEST(Buckets, NonPositiveCapIsRejected) {
  EXPECT_THROW(assign_buckets(sizes({1}), BucketOptions{0, 1}), UsageError);
}

}  // namespace
}  // namespace scaletrain
