// Note [Boxes]
// Every tensor of a run is described by its global shape, and what a rank holds of it by a box:
// offsets and sizes per dimension. This is the whole of a layout as a checkpoint sees it: DDP's
// replicas hold the whole box, ZeRO's flat shards hold a box of the flattened tensor, tensor
// parallelism holds a box cut along the split dimension. PyTorch's distributed checkpoint (DCP)
// saves each box as a chunk (ChunkStorageMetadata: offsets, sizes), and loading at another
// layout reads, for each box wanted, its intersection with every saved chunk.
//
// Planning a read is therefore geometry alone. For each chunk C and request R, per dimension,
// lo = max(C.lo, R.lo) and hi = min(C.hi, R.hi); the chunk contributes when hi > lo everywhere.
// The contribution is the box [lo, hi) seen from the chunk (lo - C.lo) and from the request
// (lo - R.lo). The request is filled exactly once when the contributions do not overlap and
// their volumes add up to the request's: overlaps are found with a sweep along dimension 0
// (chunks of row, column and flat splits rarely share a row range, so the active set stays
// small), and a missing element is named by splitting the request around the contributions.

#include "scaletrain/box.h"

#include <algorithm>
#include <optional>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

std::string shape_text(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

void check_box(const std::string& name, const std::vector<int64_t>& shape, const Box& b,
               const std::string& what) {
  const std::string where = "tensor '" + name + "' of shape " + shape_text(shape) + ": " + what;
  if (b.offsets.size() != shape.size() || b.sizes.size() != shape.size()) {
    throw UsageError(where + " has " + std::to_string(b.offsets.size()) + " offsets and " +
                     std::to_string(b.sizes.size()) + " sizes for a tensor of " +
                     std::to_string(shape.size()) + " dimensions");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (b.sizes[d] < 0 || b.offsets[d] < 0 || b.offsets[d] + b.sizes[d] > shape[d]) {
      throw UsageError(where + " " + describe(b) + " does not fit in it (dimension " +
                       std::to_string(d) + ")");
    }
  }
}

namespace {

bool overlap(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d])
      return false;
  }
  return true;
}

// An element of `b` in none of `covered` (boxes in the same coordinates), if any.
std::optional<std::vector<int64_t>> uncovered(const Box& b, const std::vector<Box>& covered) {
  if (b.numel() == 0) return std::nullopt;
  for (const Box& c : covered) {
    if (c.numel() == 0 || !overlap(b, c)) continue;
    for (size_t d = 0; d < b.offsets.size(); ++d) {
      const int64_t lo = b.offsets[d], hi = lo + b.sizes[d];
      const int64_t cut = c.offsets[d] > lo ? c.offsets[d] : c.offsets[d] + c.sizes[d];
      if (cut <= lo || cut >= hi) continue;  // c spans b in this dimension
      Box left = b, right = b;
      left.sizes[d] = cut - lo;
      right.offsets[d] = cut;
      right.sizes[d] = hi - cut;
      auto found = uncovered(left, covered);
      return found ? found : uncovered(right, covered);
    }
    return std::nullopt;  // c contains b
  }
  return b.offsets;
}

// The first pair of `reads` whose destinations overlap, as indices; nullopt when none do.
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<BoxRead>& reads) {
  if (reads.empty() || reads[0].dest.offsets.empty()) {
    if (reads.size() > 1) return std::make_pair(size_t{0}, size_t{1});  // 0-d: one element
    return std::nullopt;
  }
  std::vector<size_t> order(reads.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return reads[a].dest.offsets[0] < reads[b].dest.offsets[0];
  });
  std::vector<size_t> active;  // reads whose rows reach past the current start
  for (size_t i : order) {
    const int64_t start = reads[i].dest.offsets[0];
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](size_t a) {
                                  return reads[a].dest.offsets[0] + reads[a].dest.sizes[0] <= start;
                                }),
                 active.end());
    for (size_t a : active) {
      if (overlap(reads[a].dest, reads[i].dest))
        return std::make_pair(std::min(a, i), std::max(a, i));
    }
    active.push_back(i);
  }
  return std::nullopt;
}

std::vector<BoxRead> plan(const std::string& name, const std::vector<int64_t>& shape,
                          const std::vector<Box>& chunks, const Box& request, bool saving) {
  check_box(name, shape, request, "the requested box");
  for (size_t c = 0; c < chunks.size(); ++c)
    check_box(name, shape, chunks[c], "chunk " + std::to_string(c));
  std::vector<BoxRead> reads;
  if (request.numel() == 0) return reads;
  int64_t filled = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    BoxRead r;
    r.chunk = c;
    bool empty = false;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t lo = std::max(chunks[c].offsets[d], request.offsets[d]);
      const int64_t hi = std::min(chunks[c].offsets[d] + chunks[c].sizes[d],
                                  request.offsets[d] + request.sizes[d]);
      if (hi <= lo) empty = true;
      r.source.offsets.push_back(lo - chunks[c].offsets[d]);
      r.dest.offsets.push_back(lo - request.offsets[d]);
      r.source.sizes.push_back(std::max<int64_t>(hi - lo, 0));
    }
    if (empty || chunks[c].numel() == 0) continue;
    r.dest.sizes = r.source.sizes;
    filled += r.dest.numel();
    reads.push_back(std::move(r));
  }
  const std::string tensor = "tensor '" + name + "' of shape " + shape_text(shape);
  if (auto pair = first_overlap(reads)) {
    const size_t a = reads[pair->first].chunk, b = reads[pair->second].chunk;
    const std::string msg = tensor + ": chunks " + std::to_string(a) + " " + describe(chunks[a]) +
                            " and " + std::to_string(b) + " " + describe(chunks[b]) + " overlap" +
                            (saving ? "; give each element to one rank's box only"
                                    : "; the checkpoint's metadata is inconsistent");
    if (saving) throw UsageError(msg);
    throw Error(msg);
  }
  if (filled != request.numel()) {
    std::vector<Box> covered;
    for (const auto& r : reads) covered.push_back(r.dest);
    Box local{std::vector<int64_t>(shape.size(), 0), request.sizes};
    auto at = uncovered(local, covered).value_or(std::vector<int64_t>{});
    for (size_t d = 0; d < at.size(); ++d) at[d] += request.offsets[d];
    const std::string msg = tensor + ": element " + shape_text(at) + " of " + describe(request) +
                            " is in no " + (saving ? "rank's box" : "saved chunk") + " (" +
                            std::to_string(chunks.size()) + " chunks cover " +
                            std::to_string(filled) + " of its " + std::to_string(request.numel()) +
                            " elements)" +
                            (saving ? "; every element needs a rank that saves it"
                                    : "; was the checkpoint saved by every rank?");
    if (saving) throw UsageError(msg);
    throw Error(msg);
  }
  return reads;
}

}  // namespace

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

Box whole(const std::vector<int64_t>& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

std::vector<BoxRead> plan_box_reads(const std::string& name, const std::vector<int64_t>& shape,
                                    const std::vector<Box>& chunks, const Box& request) {
  return plan(name, shape, chunks, request, /*saving=*/false);
}

void check_tiling(const std::string& name, const std::vector<int64_t>& shape,
                  const std::vector<Box>& chunks) {
  plan(name, shape, chunks, whole(shape), /*saving=*/true);
}

Box clip(const Box& box, const std::vector<int64_t>& shape) {
  Box out = box;
  for (size_t d = 0; d < box.offsets.size() && d < shape.size(); ++d) {
    out.offsets[d] = std::min(box.offsets[d], shape[d]);
    out.sizes[d] =
        std::max<int64_t>(0, std::min(box.offsets[d] + box.sizes[d], shape[d]) - out.offsets[d]);
  }
  return out;
}

namespace {

// flat_range_boxes() of the dimensions from `d` on, for elements [b, e) of that sub-tensor, each
// box prefixed with `lead` (the offsets of the dimensions before `d`, of size 1 each).
void range_boxes(const std::vector<int64_t>& shape, size_t d, int64_t b, int64_t e,
                 const std::vector<int64_t>& lead, std::vector<Box>& out) {
  if (b >= e) return;
  auto box = [&](std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
    Box x{lead, std::vector<int64_t>(lead.size(), 1)};
    x.offsets.insert(x.offsets.end(), offsets.begin(), offsets.end());
    x.sizes.insert(x.sizes.end(), sizes.begin(), sizes.end());
    out.push_back(std::move(x));
  };
  if (d == shape.size()) return box({}, {});  // a 0-d tensor's one element
  const std::vector<int64_t> rest(shape.begin() + static_cast<long>(d) + 1, shape.end());
  const int64_t row = Box{{}, rest}.numel();      // elements per index of dimension d
  const int64_t first = b / row, last = e / row;  // the rows b and e fall in
  auto within = [&](int64_t r, int64_t from, int64_t to) {
    std::vector<int64_t> l = lead;
    l.push_back(r);
    range_boxes(shape, d + 1, from, to, l, out);
  };
  if (first == last) return within(first, b - first * row, e - first * row);
  int64_t full = first;
  if (b % row != 0) within(first, b % row, row), ++full;  // the end of a partial first row
  if (last > full) {
    std::vector<int64_t> offsets(rest.size() + 1, 0), sizes = rest;
    offsets[0] = full;
    sizes.insert(sizes.begin(), last - full);
    box(offsets, sizes);
  }
  if (e % row != 0) within(last, 0, e % row);  // the start of a partial last row
}

}  // namespace

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  const int64_t n = whole(shape).numel();
  if (begin < 0 || end < begin || end > n) {
    throw UsageError("the flat range [" + std::to_string(begin) + ", " + std::to_string(end) +
                     ") is not inside a tensor of shape " + shape_text(shape) + " (" +
                     std::to_string(n) + " elements)");
  }
  std::vector<Box> out;
  range_boxes(shape, 0, begin, end, {}, out);
  return out;
}

std::string describe(const Box& box) {
  std::string s = "[";
  for (size_t d = 0; d < box.offsets.size(); ++d) {
    s += (d ? ", " : "") + std::to_string(box.offsets[d]) + ":" +
         std::to_string(box.offsets[d] + (d < box.sizes.size() ? box.sizes[d] : 0));
  }
  return s + "]";
}

}  // namespace scaletrain
