// Note [Units]
// ~~~~~~~~~~~~
// Every collective of sharded data parallelism moves one unit: a run of consecutive groups —
// parameters in stages 1 and 2, blocks of a chain in stage 3 (a block is never split, so that a
// unit's forward is its blocks' forward) — of up to `cap` elements, FSDP's wrapping by size. A
// unit is laid out flat, its groups one after another, and padded with zeros to a multiple of the
// world size N, so that rank r's shard is elements [r·S, (r+1)·S) with S = padded / N: every
// shard the same size (reduce-scatter and all-gather need it), at most N − 1 padding elements per
// unit. Padding stays zero through training: its gradient is zero, and SGD, Adam and AdamW leave
// a zero parameter with zero gradient at zero.
//
//   groups:  [ 6 ][ 3 ][   10   ][ 0 ][ 2 ]      cap 10, N 4
//   units:   [ 6  3 ] [  10  0 ] [ 2 ]
//   padded:     12       12        4             shards 3, 3 and 1 element

#include <map>
#include <string>

#include "scaletrain/error.h"
#include "scaletrain/zero.h"
#include "zero/impl.h"

namespace scaletrain {

std::vector<UnitRange> plan_units(const std::vector<int64_t>& group_numels, int64_t cap_numel,
                                  int world) {
  if (world < 1) throw UsageError("plan_units: world size " + std::to_string(world) + " < 1");
  std::vector<UnitRange> units;
  for (size_t g = 0; g < group_numels.size(); ++g) {
    const int64_t n = group_numels[g];
    if (n < 0) throw UsageError("plan_units: group " + std::to_string(g) + " has negative size");
    const bool fits = !units.empty() && (n == 0 || units.back().numel + n <= cap_numel);
    const bool open = !units.empty() && units.back().numel == 0;  // only empty groups so far
    if (fits || open) {
      units.back().count += 1;
      units.back().numel += n;
    } else {
      units.push_back({g, 1, n, 0});
    }
  }
  for (auto& u : units) u.padded = (u.numel + world - 1) / world * world;
  return units;
}

namespace {
// Whether `p` is one that the units leave out: frozen, or ignored (ShardOptions).
bool left_out(const at::Tensor& p, const std::vector<at::Tensor>& ignored) {
  if (!p.requires_grad()) return true;
  for (const auto& q : ignored) {
    if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
  }
  return false;
}
}  // namespace

ZeroCollected collect_module(torch::nn::Module& m, const std::vector<at::Tensor>& ignored) {
  ZeroCollected c;
  for (auto& item : m.named_parameters(/*recurse=*/true)) {
    if (left_out(item.value(), ignored)) continue;
    c.names.push_back(item.key());
    c.params.push_back(item.value());
  }
  return c;
}

// Parameters in block order; a parameter two blocks share cannot live in two units.
ZeroCollected collect_chain(torch::nn::SequentialImpl& chain,
                            const std::vector<at::Tensor>& ignored) {
  ZeroCollected c;
  std::map<const void*, std::string> seen;
  auto children = chain.named_children();
  size_t b = 0;
  for (auto& any : chain) {
    c.blocks.push_back(any);
    const std::string& block = children[b].key();
    std::vector<size_t> mine;
    for (auto& item : children[b].value()->named_parameters(/*recurse=*/true)) {
      if (left_out(item.value(), ignored)) continue;
      const auto name = block + "." + item.key();
      auto [it, fresh] = seen.emplace(item.value().unsafeGetTensorImpl(), name);
      if (!fresh) {
        throw UsageError("ShardedDataParallel: parameter '" + name + "' is also '" + it->second +
                         "' of another block; a parameter shared by blocks (tied weights) must "
                         "live in one block");
      }
      mine.push_back(c.params.size());
      c.names.push_back(name);
      c.params.push_back(item.value());
    }
    c.block_params.push_back(std::move(mine));
    ++b;
  }
  return c;
}

}  // namespace scaletrain
