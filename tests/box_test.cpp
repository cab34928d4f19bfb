// The box planner against tables written by hand (Note [Boxes] in src/plan/box.cpp).

#include "scaletrain/box.h"

#include <gtest/gtest.h>

#include <functional>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Reads = std::vector<BoxRead>;
using V = std::vector<int64_t>;

Box box(V offsets, V sizes) { return Box{std::move(offsets), std::move(sizes)}; }
BoxRead box_read(size_t chunk, Box source, Box dest) { return BoxRead{chunk, source, dest}; }

std::string plan_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// 1-D, 10 elements saved over 4 ranks as torch.chunk splits them: 3, 3, 3, 1.
TEST(BoxPlan, UnevenOneDimensionalSplitReadAtAnotherWorldSize) {
  const V shape{10};
  const std::vector<Box> saved = {box({0}, {3}), box({3}, {3}), box({6}, {3}), box({9}, {1})};
  //   saved   [0 1 2][3 4 5][6 7 8][9]
  //   rank 0 of 3 (4, 3, 3): [0 1 2 3]      rank 2: [7 8 9]
  EXPECT_EQ(plan_box_reads("w", shape, saved, box({0}, {4})),
            (Reads{box_read(0, box({0}, {3}), box({0}, {3})),
                   box_read(1, box({0}, {1}), box({3}, {1}))}));
  EXPECT_EQ(plan_box_reads("w", shape, saved, box({7}, {3})),
            (Reads{box_read(2, box({1}, {2}), box({0}, {2})),
                   box_read(3, box({0}, {1}), box({2}, {1}))}));
  // The whole tensor: every chunk once, whole.
  EXPECT_EQ(plan_box_reads("w", shape, saved, box({0}, {10})).size(), 4u);
}

// 2-D, 6 x 4 by rows in 3 chunks; a request of rows 1-4, columns 1-2 (the header's drawing).
TEST(BoxPlan, TwoDimensionalRequestAcrossSeveralChunks) {
  const V shape{6, 4};
  const std::vector<Box> rows = {box({0, 0}, {2, 4}), box({2, 0}, {2, 4}), box({4, 0}, {2, 4})};
  EXPECT_EQ(plan_box_reads("w", shape, rows, box({1, 1}, {4, 2})),
            (Reads{box_read(0, box({1, 1}, {1, 2}), box({0, 0}, {1, 2})),
                   box_read(1, box({0, 1}, {2, 2}), box({1, 0}, {2, 2})),
                   box_read(2, box({0, 1}, {1, 2}), box({3, 0}, {1, 2}))}));
}

// Saved by rows, read by columns (tensor parallelism at another split dimension), uneven: 5 x 5
// saved as rows 3 + 2, read as columns 2 + 3.
//        c0 c1 | c2 c3 c4
//   r0   A  A  | A  A  A      chunk 0: rows 0-2
//   r1   A  A  | A  A  A
//   r2   A  A  | A  A  A
//   r3   B  B  | B  B  B      chunk 1: rows 3-4
//   r4   B  B  | B  B  B
TEST(BoxPlan, RowsSavedColumnsRead) {
  const V shape{5, 5};
  const std::vector<Box> rows = {box({0, 0}, {3, 5}), box({3, 0}, {2, 5})};
  EXPECT_EQ(plan_box_reads("w", shape, rows, box({0, 2}, {5, 3})),
            (Reads{box_read(0, box({0, 2}, {3, 3}), box({0, 0}, {3, 3})),
                   box_read(1, box({0, 2}, {2, 3}), box({3, 0}, {2, 3}))}));
}

// A request inside one chunk touches that chunk alone, at its offset within the chunk.
TEST(BoxPlan, RequestInsideOneChunk) {
  const V shape{8, 6};
  const std::vector<Box> cols = {box({0, 0}, {8, 3}), box({0, 3}, {8, 3})};
  EXPECT_EQ(plan_box_reads("w", shape, cols, box({2, 4}, {3, 2})),
            (Reads{box_read(1, box({2, 1}, {3, 2}), box({0, 0}, {3, 2}))}));
}

// A 2-D grid of chunks (2 x 2, uneven) read whole.
TEST(BoxPlan, GridOfChunksReadWhole) {
  const V shape{3, 5};
  const std::vector<Box> grid = {box({0, 0}, {2, 3}), box({0, 3}, {2, 2}), box({2, 0}, {1, 3}),
                                 box({2, 3}, {1, 2})};
  EXPECT_EQ(plan_box_reads("w", shape, grid, box({0, 0}, {3, 5})),
            (Reads{box_read(0, box({0, 0}, {2, 3}), box({0, 0}, {2, 3})),
                   box_read(1, box({0, 0}, {2, 2}), box({0, 3}, {2, 2})),
                   box_read(2, box({0, 0}, {1, 3}), box({2, 0}, {1, 3})),
                   box_read(3, box({0, 0}, {1, 2}), box({2, 3}, {1, 2}))}));
}

// ZeRO pads a flat buffer of 10 to 12 over 4 ranks (shards of 3): the last real shard is 1
// element and a rank may hold only padding. Saved chunks are the real parts (clip); a request
// at another world size is the padded box clipped the same way, and the rest of it stays zero.
//   flat      0 1 2 | 3 4 5 | 6 7 8 | 9 p p
//   world 3   0 1 2 3 | 4 5 6 7 | 8 9 p p     (shards of 4)
TEST(BoxPlan, PaddedShardsAreClippedToTheTensor) {
  const V shape{10};
  std::vector<Box> saved;
  for (int64_t r = 0; r < 4; ++r) saved.push_back(clip(box({3 * r}, {3}), shape));
  EXPECT_EQ(saved[3], box({9}, {1}));  // the shorter shard
  const Box last = clip(box({8}, {4}), shape);
  EXPECT_EQ(last, box({8}, {2}));
  EXPECT_EQ(plan_box_reads("w", shape, saved, last),
            (Reads{box_read(2, box({2}, {1}), box({0}, {1})),
                   box_read(3, box({0}, {1}), box({1}, {1}))}));
  // A rank holding padding only: its clipped box is empty, its chunk contributes nothing.
  EXPECT_EQ(clip(box({12}, {4}), shape), box({10}, {0}));
  saved.push_back(clip(box({12}, {3}), shape));
  EXPECT_EQ(plan_box_reads("w", shape, saved, whole(shape)).size(), 4u);
}

TEST(BoxPlan, ZeroSizeTensorsAndRequests) {
  // A tensor with a zero dimension: no chunk needed, nothing to read.
  EXPECT_EQ(plan_box_reads("e", {0, 4}, {}, whole({0, 4})), Reads{});
  EXPECT_NO_THROW(check_tiling("e", {0, 4}, {box({0, 0}, {0, 4})}));
  // An empty request of a real tensor reads nothing, even with nothing saved.
  EXPECT_EQ(plan_box_reads("w", {4}, {}, box({2}, {0})), Reads{});
}

// A 0-d tensor (Adam's step) is one element: one chunk of no dimensions.
TEST(BoxPlan, ScalarTensor) {
  EXPECT_EQ(plan_box_reads("step", {}, {box({}, {})}, whole({})),
            (Reads{box_read(0, box({}, {}), box({}, {}))}));
  EXPECT_NE(plan_error([] { plan_box_reads("step", {}, {}, whole({})); }).find("is in no saved"),
            std::string::npos);
}

TEST(BoxPlan, MissingElementIsNamed) {
  const std::vector<Box> gap = {box({0, 0}, {2, 4}), box({3, 0}, {3, 4})};  // row 2 missing
  const std::string msg = plan_error([&] {
    plan_box_reads("w", {6, 4}, gap, box({1, 1}, {3, 2}));
  });
  EXPECT_NE(msg.find("tensor 'w' of shape [6, 4]: element [2, 1] of [1:4, 1:3] is in no saved "
                     "chunk (2 chunks cover 4 of its 6 elements)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("saved by every rank"), std::string::npos) << msg;
  const std::string save = plan_error([&] { check_tiling("w", {6, 4}, gap); });
  EXPECT_NE(save.find("element [2, 0] of [0:6, 0:4] is in no rank's box"), std::string::npos)
      << save;
}

TEST(BoxPlan, OverlapsAreErrors) {
  const std::vector<Box> twice = {box({0}, {6}), box({4}, {6})};
  const std::string msg = plan_error([&] { check_tiling("b", {10}, twice); });
  EXPECT_NE(msg.find("chunks 0 [0:6] and 1 [4:10] overlap; give each element to one rank"),
            std::string::npos)
      << msg;
  // Outside the request, an overlap does not matter.
  EXPECT_EQ(plan_box_reads("b", {10}, twice, box({0}, {3})).size(), 1u);
  // Two chunks of a 0-d tensor hold its one element twice.
  EXPECT_THROW(check_tiling("s", {}, {box({}, {}), box({}, {})}), UsageError);
}

TEST(BoxPlan, ShapeMismatchesAreUsageErrors) {
  const std::vector<Box> rows = {box({0, 0}, {2, 4})};
  // A request of another rank, outside the shape, a chunk past the edge, a negative size.
  EXPECT_NE(plan_error([&] {
              plan_box_reads("w", {2, 4}, rows, box({0}, {2}));
            }).find("the requested box has 1 offsets and 1 sizes for a tensor of 2 dimensions"),
            std::string::npos);
  EXPECT_NE(plan_error([&] {
              plan_box_reads("w", {2, 4}, rows, box({0, 2}, {2, 3}));
            }).find("the requested box [0:2, 2:5] does not fit in it (dimension 1)"),
            std::string::npos);
  EXPECT_NE(plan_error([&] {
              plan_box_reads("w", {2, 3}, rows, box({0, 0}, {1, 1}));
            }).find("tensor 'w' of shape [2, 3]: chunk 0 [0:2, 0:4] does not fit"),
            std::string::npos);
  EXPECT_THROW(plan_box_reads("w", {2, 4}, rows, box({0, 0}, {-1, 4})), UsageError);
}

// A flat range of a 4 x 3 weight (a ZeRO shard of it) as boxes of its own shape:
//        c0 c1 c2
//   r0    .  .  A      [2, 7): A = [0:1, 2:3], B = [1:2, 0:3], C = [2:3, 0:1]
//   r1    B  B  B
//   r2    C  .  .
//   r3    .  .  .
TEST(BoxPlan, FlatRangesAsBoxesOfTheTensorsShape) {
  EXPECT_EQ(flat_range_boxes({4, 3}, 2, 7),
            (std::vector<Box>{box({0, 2}, {1, 1}), box({1, 0}, {1, 3}), box({2, 0}, {1, 1})}));
  EXPECT_EQ(flat_range_boxes({4, 3}, 3, 9), (std::vector<Box>{box({1, 0}, {2, 3})}));
  EXPECT_EQ(flat_range_boxes({4, 3}, 4, 5), (std::vector<Box>{box({1, 1}, {1, 1})}));
  EXPECT_EQ(flat_range_boxes({10}, 9, 10), (std::vector<Box>{box({9}, {1})}));
  EXPECT_EQ(flat_range_boxes({}, 0, 1), (std::vector<Box>{box({}, {})}));
  EXPECT_EQ(flat_range_boxes({4, 3}, 5, 5), std::vector<Box>{});
  // 2 x 3 x 4, [5, 19): the rest of row 1 and row 2 of the first matrix, then rows 0 and part
  // of row 1 of the second.
  EXPECT_EQ(flat_range_boxes({2, 3, 4}, 5, 19),
            (std::vector<Box>{box({0, 1, 1}, {1, 1, 3}), box({0, 2, 0}, {1, 1, 4}),
                              box({1, 0, 0}, {1, 1, 4}), box({1, 1, 0}, {1, 1, 3})}));
  EXPECT_THROW(flat_range_boxes({4, 3}, 8, 13), UsageError);
}

// Every range of every small shape: the boxes hold exactly its elements, at most 2·dims − 1.
TEST(BoxPlan, FlatRangeBoxesHoldExactlyTheRange) {
  for (const V& shape : {V{5}, V{3, 4}, V{2, 3, 2}, V{2, 1, 3, 2}, V{1, 4}}) {
    const int64_t n = whole(shape).numel();
    for (int64_t b = 0; b <= n; ++b) {
      for (int64_t e = b; e <= n; ++e) {
        std::vector<int> hits(static_cast<size_t>(n), 0);
        const auto boxes = flat_range_boxes(shape, b, e);
        EXPECT_LE(boxes.size(), 2 * shape.size() - 1);
        for (const Box& x : boxes) {
          check_box("t", shape, x, "a box");
          for (int64_t k = 0; k < n; ++k) {  // is flat index k in x?
            bool in = true;
            for (size_t d = shape.size(), rem = static_cast<size_t>(k); d-- > 0;) {
              const int64_t i = static_cast<int64_t>(rem % static_cast<size_t>(shape[d]));
              rem /= static_cast<size_t>(shape[d]);
              in = in && i >= x.offsets[d] && i < x.offsets[d] + x.sizes[d];
            }
            hits[static_cast<size_t>(k)] += in;
          }
        }
        for (int64_t k = 0; k < n; ++k)
          EXPECT_EQ(hits[static_cast<size_t>(k)], k >= b && k < e) << k << " of " << b << "-" << e;
      }
    }
  }
}

TEST(BoxPlan, DescribeIsPythonSlices) {
  EXPECT_EQ(describe(box({2, 0}, {2, 3})), "[2:4, 0:3]");
  EXPECT_EQ(describe(box({}, {})), "[]");
  EXPECT_EQ(whole({3, 2}), box({0, 0}, {3, 2}));
  EXPECT_EQ(box({1, 1}, {2, 3}).numel(), 6);
}

}  // namespace
}  // namespace scaletrain
