// Which parameters the plan split, and the whole model's state from (and into) the
// tensor-parallel slices of its ranks: replicated_parameters(), gather_full_state() and
// load_full_state() (tensor_parallel.h), under the names the unsplit model has, each split
// parameter put back together along the dimension its style cut.

#include <ATen/ops/cat.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"
#include "scaletrain/tensor_parallel.h"
#include "tp/split.h"

namespace scaletrain {
namespace {

// Where a split parameter's slices go back together, and over which group: the caller's tp,
// or a group of the parameter's own (a MoE layer's experts over its ep group: expert_parallel.h).
// Experts sharded over edp as well are cut twice along dimension 0, over ep and then within
// each part over edp: one cut over ep x edp ranks, edp-rank m of ep-rank j the (j M + m)-th.
struct Split {
  int64_t dim = 0;
  int64_t chunks = 1;
  const Dist* group = nullptr;  // null: the tp group the caller gives
  const Dist* inner = nullptr;  // experts sharded over edp (chunks 1)
  const Dist& over(const Dist& tp) const { return group != nullptr ? *group : tp; }
  int rank(const Dist& tp) const {
    return inner == nullptr ? over(tp).rank() : over(tp).rank() * inner->size() + inner->rank();
  }
  int size(const Dist& tp) const {
    return over(tp).size() * (inner == nullptr ? 1 : inner->size());
  }
};

// Every split parameter of `module`, by its name there.
std::map<std::string, Split> split_parameters(torch::nn::Module& module) {
  std::map<std::string, Split> out;
  for (const auto& item : module.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    if (auto* l = dynamic_cast<ParallelLinearImpl*>(item.value().get())) {
      const auto& s = l->style();
      if (s.kind == ParallelStyle::Kind::kColwise) {
        out[prefix + "weight"] = {0, s.chunks};
        if (l->bias.defined()) out[prefix + "bias"] = {0, s.chunks};
      } else if (s.kind == ParallelStyle::Kind::kRowwise) {
        out[prefix + "weight"] = {1, 1};
      }
    } else if (auto* e = dynamic_cast<ParallelEmbeddingImpl*>(item.value().get())) {
      if (e->style().kind == ParallelStyle::Kind::kVocab) out[prefix + "weight"] = {0, 1};
    } else if (auto* moe = dynamic_cast<MoEImpl*>(item.value().get())) {
      if (moe->ep() == nullptr && moe->edp() == nullptr) continue;  // every expert here
      for (const char* w : {"w1", "w2", "w3"}) {
        if (!moe->named_parameters(false).contains(w)) continue;
        // Over ep, then within each part over edp; sharded alone, over edp.
        out[prefix + w] =
            moe->ep() != nullptr ? Split{0, 1, moe->ep(), moe->edp()} : Split{0, 1, moe->edp()};
      }
    }
  }
  return out;
}

// A split parameter's slices (by rank) put back together: chunk c of every rank, then c + 1.
at::Tensor joined(const std::vector<at::Tensor>& slices, const Split& split) {
  std::vector<at::Tensor> parts;
  for (int64_t c = 0; c < split.chunks; ++c) {
    for (const auto& s : slices) {
      parts.push_back(s.chunk(split.chunks, split.dim)[static_cast<size_t>(c)]);
    }
  }
  return at::cat(parts, split.dim);
}

// Every rank's slice of `v` under `s`, joined (the edp shards first, within each ep part).
at::Tensor gathered(const at::Tensor& v, const Split& s, const Dist& tp) {
  at::Tensor mine = v.contiguous();
  if (s.inner != nullptr && s.inner->size() > 1) mine = at::cat(s.inner->all_gather(mine), s.dim);
  if (s.over(tp).size() == 1) return mine;
  return joined(s.over(tp).all_gather(mine.contiguous()), s);
}

}  // namespace

std::vector<at::Tensor> replicated_parameters(torch::nn::Module& module) {
  const auto split = split_parameters(module);
  std::vector<at::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    if (!split.count(p.key())) out.push_back(p.value());
  }
  return out;
}

std::map<std::string, at::Tensor> gather_full_state(torch::nn::Module& module, const Dist& tp,
                                                    bool gradients) {
  const auto split = split_parameters(module);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    // Gathered where the slice lives (NCCL carries device tensors only), returned on the CPU.
    at::Tensor v = p.value().detach();
    if (gradients) v = p.value().grad().defined() ? p.value().grad() : at::zeros_like(v);
    auto it = split.find(p.key());
    if (it == split.end() || it->second.size(tp) == 1) {
      out[p.key()] = v.cpu().clone();
      continue;
    }
    out[p.key()] = gathered(v, it->second, tp).cpu();
  }
  if (gradients) return out;
  for (const auto& b : module.named_buffers()) out[b.key()] = b.value().detach().cpu().clone();
  return out;
}

void load_full_state(torch::nn::Module& module, const Dist& tp,
                     const std::map<std::string, at::Tensor>& state) {
  for (const auto& p : module.named_parameters()) {
    if (!state.count(p.key()))
      throw UsageError("load_full_state: no '" + p.key() + "' in the state");
  }
  const auto slices = slice_full_state(module, tp, state);
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    const auto& v = slices.at(p.key());
    if (v.sizes() != p.value().sizes()) {
      throw UsageError("load_full_state: '" + p.key() + "' is " +
                       c10::str(state.at(p.key()).sizes()) +
                       " in the state; this model's slice of it is " + c10::str(p.value().sizes()));
    }
    p.value().copy_(v);
  }
}

std::map<std::string, at::Tensor> slice_full_state(torch::nn::Module& module, const Dist& tp,
                                                   const std::map<std::string, at::Tensor>& whole) {
  const auto split = split_parameters(module);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    auto it = whole.find(p.key());
    if (it == whole.end()) continue;
    auto s = split.find(p.key());
    if (s == split.end() || s->second.size(tp) == 1) {
      out[p.key()] = it->second;
      continue;
    }
    out[p.key()] = split_of(it->second, s->second.dim, s->second.chunks, s->second.rank(tp),
                            s->second.size(tp));
  }
  return out;
}

std::map<std::string, at::Tensor> gather_full_tensors(
    torch::nn::Module& module, const Dist& tp, const std::map<std::string, at::Tensor>& slices) {
  const auto split = split_parameters(module);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) {  // the same order on every rank
    auto it = slices.find(p.key());
    if (it == slices.end()) continue;
    auto s = split.find(p.key());
    out[p.key()] = s == split.end() || s->second.size(tp) == 1
                       ? it->second.detach().cpu().clone()
                       : gathered(it->second.detach(), s->second, tp).cpu();
  }
  return out;
}

std::map<std::string, SlicePlacement> slice_placements(torch::nn::Module& module, const Dist& tp) {
  const auto split = split_parameters(module);
  std::map<std::string, SlicePlacement> out;
  for (const auto& p : module.named_parameters()) {
    const auto shape = p.value().sizes().vec();
    SlicePlacement& place = out[p.key()];
    place.whole_shape = shape;
    auto s = split.find(p.key());
    if (s == split.end() || s->second.size(tp) == 1) {
      place.pieces.push_back({whole(shape), std::vector<int64_t>(shape.size(), 0)});
      continue;
    }
    const int rank = s->second.rank(tp), ranks = s->second.size(tp);
    // Chunk c of every rank lies before chunk c + 1 (joined() above): rank r's chunk c at
    // (the chunks before it, of every rank) + r · (its size).
    // Sizes only: a sharded strategy's module may hold no storage. Tensor::chunk's sizes:
    // ceil(L / chunks) each, the last the rest.
    const auto d = static_cast<size_t>(s->second.dim);
    place.whole_shape[d] = shape[d] * ranks;
    const int64_t step = (shape[d] + s->second.chunks - 1) / s->second.chunks;
    for (int64_t local = 0; local < shape[d]; local += step) {
      const int64_t size = std::min(step, shape[d] - local);
      SlicePlacement::Piece piece{whole(shape), std::vector<int64_t>(shape.size(), 0)};
      piece.local.offsets[d] = local;
      piece.local.sizes[d] = size;
      piece.global_offsets[d] = local * ranks + rank * size;
      place.pieces.push_back(std::move(piece));
    }
  }
  return out;
}

std::string describe_split(torch::nn::Module& module) {
  std::string out;
  for (const auto& [name, s] : split_parameters(module)) {
    if (s.group != nullptr) {
      throw UsageError("describe_split: '" + name +
                       "' is split over a group of its own (expert "
                       "parallelism); sharded checkpoints of it are not supported");
    }
    out += name + " " + std::to_string(s.dim) + " " + std::to_string(s.chunks) + "\n";
  }
  return out;
}

std::map<std::string, at::Tensor> join_slices(
    const std::vector<std::map<std::string, at::Tensor>>& slices, const std::string& split) {
  std::map<std::string, Split> how;
  std::stringstream lines(split);
  for (std::string name; lines >> name;) lines >> how[name].dim >> how[name].chunks;
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, first] : slices.at(0)) {
    auto s = how.find(name);
    if (s == how.end() || slices.size() == 1) {
      out[name] = first;
      continue;
    }
    std::vector<at::Tensor> parts;
    for (size_t r = 0; r < slices.size(); ++r) {
      auto it = slices[r].find(name);
      if (it == slices[r].end()) {
        throw Error("join_slices: slice " + std::to_string(r) + " has no '" + name + "'");
      }
      parts.push_back(it->second);
    }
    out[name] = joined(parts, s->second);
  }
  return out;
}

}  // namespace scaletrain
