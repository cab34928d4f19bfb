// The collectives interface DDP and ZeRO use (src/dist/collectives.h, Note [Collectives]): each
// implementation — the backend alone, and shared memory for float32 CPU tensors — over world
// sizes 1 to 4, with element counts of 0, 1, an odd count and more than a segment's chunk.
#include "dist/collectives.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "scaletrain/error.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

// Rank r's part of n elements: values no two ranks share, exact in float32.
at::Tensor part(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (at::arange(n, at::kDouble) + 1000.0 * rank).to(dtype);
}

class CollectivesPaths : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(CollectivesPaths, AllGatherAndSumGiveEveryRankTheSameExactResult) {
  const auto [world, shared_memory] = GetParam();
  auto errors =
      testing::run_ranks(world, [&, world = world, shared_memory = shared_memory](Dist& d) {
        CollectivesOptions o;
        o.shared_memory = shared_memory;
        o.chunk_floats = 1000;  // 2503 elements go through the segment in three rounds
        auto c = make_collectives(d, o, "test/collectives");
        EXPECT_EQ(c->shared_memory(), shared_memory && world > 1) << c->path();
        for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{2503}}) {
          const std::string what = "n " + std::to_string(n) + " on " + c->path();
          auto out = at::full({world * n}, -1.0f);
          c->all_gather_into(out, part(d.rank(), n), "test all-gather");
          std::vector<at::Tensor> parts;
          for (int r = 0; r < world; ++r) parts.push_back(part(r, n));
          EXPECT_TRUE(at::equal(out, at::cat(parts))) << what;
          // A dtype the segment does not carry goes through the backend, with the same result.
          auto wide = at::empty({world * n}, at::kDouble);
          c->all_gather_into(wide, part(d.rank(), n, at::kDouble), "test all-gather (double)");
          EXPECT_TRUE(at::equal(wide, at::cat(parts).to(at::kDouble))) << what;
          auto sum = at::full({n}, static_cast<float>(d.rank() + 1));
          c->all_reduce_sum(sum, "test all-reduce").wait();
          EXPECT_TRUE(at::equal(sum, at::full({n}, world * (world + 1) / 2.0f))) << what;
        }
        // Sizes that do not fit are refused on the caller's rank, before any rank waits.
        auto small = at::empty({3}, at::kFloat);
        EXPECT_THROW(c->all_gather_into(small, part(d.rank(), 2), "a wrong size"), Error);
      });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
}

INSTANTIATE_TEST_SUITE_P(WorldsAndPaths, CollectivesPaths,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(false, true)),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& i) {
                           return "world" + std::to_string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) ? "_shared_memory" : "_backend");
                         });

}  // namespace
}  // namespace scaletrain
