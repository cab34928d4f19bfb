#pragma once
// Dropout across a tensor-parallel split that draws the unsplit model's masks at every degree.
//
// In a split model a tensor lies either whole on every rank of the group (a replicated region) or
// in parts (a sequence-parallel region: each rank's slice of the positions; attention: each
// rank's heads). Plain dropout on each rank's part would draw masks that depend on the degree,
// and a replicated tensor would be dropped differently on each rank, whose copies then drift
// apart. coordinated_dropout() draws the mask of the whole tensor, from a generator in the same
// state on every rank, and keeps this rank's part of it:
//
//   // in a block's forward, training, on this rank's slice of the sequence [batch, T/t, C]:
//   x = scaletrain::coordinated_dropout(x, {0.1, scaletrain::part_of(tp, 1)});
//   // on attention probabilities [batch, heads/t, T, T] (this rank's heads):
//   att = scaletrain::coordinated_dropout(att, {0.1, scaletrain::part_of(tp, 1)});
//   // on a tensor every rank holds whole:
//   y = scaletrain::coordinated_dropout(y, {0.1});
//   // context parallelism: this rank's positions of a sequence of length L (context_parallel.h):
//   scaletrain::CoordinatedDropoutOptions o{0.1, {1}};  // along the sequence, dim 1 of [B, n, C]
//   o.positions = split.positions(L), o.length = L;
//   x = scaletrain::coordinated_dropout(x, o);
//
// Contract. Every rank of the group calls it on the same tensors in the same order, and its
// generator (CoordinatedDropoutOptions::generator, or the device's default) is in the same state
// on every rank: then the masks are the ones the unsplit model draws at degree 1, whatever the
// degree, and the group's generators stay in step (each draws the whole tensor's numbers). The
// trainer seeds the ranks of a tensor-parallel group alike (Note [Rank streams] in
// src/train/rng.cpp); a program of its own seeds them alike, or gives its model a generator of
// its own, seeded alike. The cost: each rank draws t times the numbers it keeps (Megatron draws
// only its part, from a stream per rank, so its masks depend on the degree). Call it in training
// only: it always drops. Not thread-safe with other users of the same generator.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace scaletrain {

struct Dist;

/// Where a rank's tensor lies in the whole one: part `index` of `parts` equal slices along `dim`
/// (parts 1: the whole tensor).
struct TensorPart {
  // Not explicit: {dim, parts, index} and {} build one in place.
  TensorPart(int64_t dim_ = 0, int64_t parts_ = 1, int64_t index_ = 0)
      : dim(dim_), parts(parts_), index(index_) {}
  int64_t dim;
  int64_t parts;
  int64_t index;
};

/// This rank's part of a tensor split along `dim` over the group `tp`: {dim, tp.size(),
/// tp.rank()} (the sequence, dim 1 of [batch, T, C]; the heads, dim 1 of [batch, heads, T, T]).
TensorPart part_of(const Dist& tp, int64_t dim);

struct CoordinatedDropoutOptions {
  // Not explicit: {p}, {p, part} and {p, part, generator} build one in place.
  CoordinatedDropoutOptions(double p_ = 0.5, TensorPart part_ = {},
                            std::optional<at::Generator> generator_ = std::nullopt)
      : p(p_), part(part_), generator(std::move(generator_)) {}
  double p;  // the probability of dropping an element, in [0, 1)
  TensorPart part;
  std::optional<at::Generator> generator;  // unset: the tensor's device's default generator
  /// Context parallelism (context_parallel.h): defined, the whole tensor is `length` long along
  /// part.dim and this rank's slice of it holds the places `positions` (int64, in their order:
  /// ContextSplit::positions()), which part.parts then cut in equal parts (sequence parallelism
  /// within the slice). UsageError when positions' count is not part.parts times x's size
  /// there, or a position is outside the length.
  at::Tensor positions;
  int64_t length = 0;
};

/// `x` (this rank's part of the whole tensor, as `options.part` and `options.positions` say) with
/// the whole tensor's mask applied to it: elements dropped with probability p, the others scaled by
/// 1 / (1 − p). x itself for p = 0. Throws UsageError for p outside [0, 1) or a part that `x`
/// cannot be (a dimension it lacks, an index outside the parts).
at::Tensor coordinated_dropout(const at::Tensor& x, const CoordinatedDropoutOptions& options);

/// The mask coordinated_dropout() multiplies a tensor of `sizes` (dtype and device: `tensor`)
/// by, before its 1 / (1 − p): 1 kept, 0 dropped, drawn the same way, for a kernel that applies
/// it itself (ring attention). Draws even at p = 0 (all ones then). The same errors.
at::Tensor coordinated_dropout_mask(at::IntArrayRef sizes, const at::TensorOptions& tensor,
                                    const CoordinatedDropoutOptions& options);

}  // namespace scaletrain
