#pragma once
// Boxes of a tensor: the one description of who holds what (Note [Boxes] in src/plan/box.cpp).
// A tensor of a run has a global shape; a rank holds a box of it (offsets and sizes per
// dimension), whatever the parallelism that put it there (a ZeRO shard, a tensor-parallel
// slice, a pipeline stage's whole tensor). A checkpoint saves boxes as chunks; loading at any
// other layout is a box intersection, planned here:
//
//   global 6 x 4, saved by rows as 3 chunks       request rows 1-4, columns 1-2
//     rows 0-1  chunk 0  ████                        ·····
//     rows 2-3  chunk 1  ████                        ·▒▒·    reads: chunk 0 row 1,
//     rows 4-5  chunk 2  ████                        ·▒▒·           chunk 1 rows 0-1,
//                                                    ·▒▒·           chunk 2 row 0
//
// Pure functions of sizes: no LibTorch, no process group. Thread-safe.

#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain {

/// A box in a tensor of some global shape: `offsets` and `sizes`, one entry per dimension (none
/// for a 0-d tensor, whose one element is the box of no dimensions).
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

/// The box of a whole tensor of `shape` (zero offsets).
Box whole(const std::vector<int64_t>& shape);

/// One read of a plan: the part of saved chunk `chunk` that fills part of the request. `source`
/// is relative to the chunk (offsets from the chunk's corner), `dest` relative to the request;
/// both have the same sizes.
struct BoxRead {
  size_t chunk = 0;
  Box source, dest;
  bool operator==(const BoxRead& o) const {
    return chunk == o.chunk && source == o.source && dest == o.dest;
  }
};

/// The reads that fill `request` from the saved `chunks` of the tensor `name` of `shape`, in
/// chunk order, none of zero size. Every element of the request is filled exactly once.
/// Throws UsageError naming `name` and the values when a chunk or the request has another
/// number of dimensions than `shape`, lies outside it or has a negative size; and Error when two
/// chunks overlap inside the request or some element of the request is in no chunk (naming it).
std::vector<BoxRead> plan_box_reads(const std::string& name, const std::vector<int64_t>& shape,
                                    const std::vector<Box>& chunks, const Box& request);

/// Checks that `chunks` tile the tensor `name` of `shape` exactly (each element in one chunk):
/// what a checkpoint must hold to be read at any layout. Same errors as plan_box_reads().
void check_tiling(const std::string& name, const std::vector<int64_t>& shape,
                  const std::vector<Box>& chunks);

/// Throws UsageError naming `name`, `what` ("the requested box") and the values when `box` has
/// another number of dimensions than `shape`, a negative size, or lies outside it.
void check_box(const std::string& name, const std::vector<int64_t>& shape, const Box& box,
               const std::string& what);

/// The part of `box` inside a tensor of `shape` (sizes cut at the shape's edge, 0 past it): a
/// padded shard's real elements (ZeRO pads a flat buffer to a multiple of the world size).
Box clip(const Box& box, const std::vector<int64_t>& shape);

/// The boxes that hold the elements [begin, end) of a tensor of `shape` in row-major order, as
/// few as there are (at most 2·dims − 1): a ZeRO shard of a flat buffer is a range of each
/// parameter's flattened elements, and a checkpoint saves it as boxes of the parameter's own
/// shape, which Python loads as such. For 4 x 3 and [2, 7): [0:1, 2:3], [1:2, 0:3], [2:3, 0:1].
/// Throws UsageError for a range outside the tensor.
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

/// "[2:4, 0:3]" (a Python slice per dimension), for messages.
std::string describe(const Box& box);

}  // namespace scaletrain
