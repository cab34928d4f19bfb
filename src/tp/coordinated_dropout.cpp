// Dropout across a tensor-parallel split (coordinated_dropout.h): the whole tensor's mask, drawn
// alike on every rank of the group, cut to this rank's part.

#include "scaletrain/coordinated_dropout.h"

#include <ATen/ops/empty.h>

#include <string>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"

namespace scaletrain {

TensorPart part_of(const Dist& tp, int64_t dim) { return {dim, tp.size(), tp.rank()}; }

at::Tensor coordinated_dropout(const at::Tensor& x, const CoordinatedDropoutOptions& o) {
  if (!(o.p >= 0 && o.p < 1)) {
    throw UsageError("coordinated_dropout: p " + std::to_string(o.p) +
                     " is not a probability in [0, 1)");
  }
  const TensorPart& part = o.part;
  const int64_t dim = part.dim < 0 ? part.dim + x.dim() : part.dim;
  if (dim < 0 || dim >= x.dim() || part.parts < 1 || part.index < 0 || part.index >= part.parts) {
    throw UsageError("coordinated_dropout: a " + c10::str(x.sizes()) + " tensor cannot be part " +
                     std::to_string(part.index) + " of " + std::to_string(part.parts) +
                     " along dimension " + std::to_string(part.dim) +
                     "; give the dimension the whole tensor is split along and this rank's part "
                     "(part_of(tp, dim))");
  }
  const bool placed = o.positions.defined();
  if (placed && (o.positions.numel() != x.size(dim) * part.parts ||
                 (o.positions.numel() > 0 && (o.positions.min().item<int64_t>() < 0 ||
                                              o.positions.max().item<int64_t>() >= o.length)))) {
    throw UsageError("coordinated_dropout: " + std::to_string(o.positions.numel()) +
                     " positions within a length of " + std::to_string(o.length) +
                     " cannot place a " + c10::str(x.sizes()) + " tensor, part " +
                     std::to_string(part.index) + " of " + std::to_string(part.parts) +
                     " along dimension " + std::to_string(part.dim) +
                     "; give the positions of this rank's slice before the parts cut it");
  }
  if (o.p == 0) return x;
  auto shape = x.sizes().vec();
  shape[static_cast<size_t>(dim)] = placed ? o.length : x.size(dim) * part.parts;
  auto mask = at::empty(shape, x.options()).bernoulli_(1 - o.p, o.generator);
  if (placed) mask = mask.index_select(dim, o.positions.to(mask.device()));
  if (part.parts > 1) mask = mask.narrow(dim, part.index * x.size(dim), x.size(dim));
  return x * mask / (1 - o.p);
}

}  // namespace scaletrain
