// Dropout across a tensor-parallel split (coordinated_dropout.h): the whole tensor's mask, drawn
// alike on every rank of the group, cut to this rank's part.

#include "scaletrain/coordinated_dropout.h"

#include <ATen/ops/empty.h>

#include <string>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"

namespace scaletrain {

TensorPart part_of(const Dist& tp, int64_t dim) { return {dim, tp.size(), tp.rank()}; }

namespace {

// UsageError unless `o` can place a part of `sizes`; returns the part's dimension (counted from 0).
int64_t checked_dim(at::IntArrayRef sizes, const CoordinatedDropoutOptions& o) {
  if (!(o.p >= 0 && o.p < 1)) {
    throw UsageError("coordinated_dropout: p " + std::to_string(o.p) +
                     " is not a probability in [0, 1)");
  }
  const TensorPart& part = o.part;
  const auto rank = static_cast<int64_t>(sizes.size());
  const int64_t dim = part.dim < 0 ? part.dim + rank : part.dim;
  if (dim < 0 || dim >= rank || part.parts < 1 || part.index < 0 || part.index >= part.parts) {
    throw UsageError("coordinated_dropout: a " + c10::str(sizes) + " tensor cannot be part " +
                     std::to_string(part.index) + " of " + std::to_string(part.parts) +
                     " along dimension " + std::to_string(part.dim) +
                     "; give the dimension the whole tensor is split along and this rank's part "
                     "(part_of(tp, dim))");
  }
  if (o.positions.defined() &&
      (o.positions.numel() != sizes[dim] * part.parts ||
       (o.positions.numel() > 0 && (o.positions.min().item<int64_t>() < 0 ||
                                    o.positions.max().item<int64_t>() >= o.length)))) {
    throw UsageError("coordinated_dropout: " + std::to_string(o.positions.numel()) +
                     " positions within a length of " + std::to_string(o.length) +
                     " cannot place a " + c10::str(sizes) + " tensor, part " +
                     std::to_string(part.index) + " of " + std::to_string(part.parts) +
                     " along dimension " + std::to_string(part.dim) +
                     "; give the positions of this rank's slice before the parts cut it");
  }
  return dim;
}

// The whole tensor's mask (1 kept, 0 dropped), drawn, cut to the part of `sizes` (checked).
at::Tensor draw(at::IntArrayRef sizes, const at::TensorOptions& options,
                const CoordinatedDropoutOptions& o, int64_t dim) {
  const TensorPart& part = o.part;
  const bool placed = o.positions.defined();
  auto shape = sizes.vec();
  shape[static_cast<size_t>(dim)] = placed ? o.length : sizes[dim] * part.parts;
  auto mask = at::empty(shape, options).bernoulli_(1 - o.p, o.generator);
  if (placed) mask = mask.index_select(dim, o.positions.to(mask.device()));
  if (part.parts > 1) mask = mask.narrow(dim, part.index * sizes[dim], sizes[dim]);
  return mask;
}

}  // namespace

at::Tensor coordinated_dropout_mask(at::IntArrayRef sizes, const at::TensorOptions& options,
                                    const CoordinatedDropoutOptions& o) {
  return draw(sizes, options, o, checked_dim(sizes, o));
}

at::Tensor coordinated_dropout(const at::Tensor& x, const CoordinatedDropoutOptions& o) {
  const int64_t dim = checked_dim(x.sizes(), o);
  if (o.p == 0) return x;
  return x * draw(x.sizes(), x.options(), o, dim) / (1 - o.p);
}

}  // namespace scaletrain
