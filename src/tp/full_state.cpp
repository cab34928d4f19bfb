// Which parameters the plan split, and the whole model's state from (and into) the
// tensor-parallel slices of its ranks: replicated_parameters(), gather_full_state() and
// load_full_state() (tensor_parallel.h), under the names the unsplit model has, each split
// parameter put back together along the dimension its style cut.

#include <ATen/ops/cat.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "scaletrain/tensor_parallel.h"
#include "tp/split.h"

namespace scaletrain {
namespace {

// Where a split parameter's slices go back together.
struct Split {
  int64_t dim = 0;
  int64_t chunks = 1;
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
    }
  }
  return out;
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
    if (it == split.end() || tp.size() == 1) {
      out[p.key()] = v.cpu().clone();
      continue;
    }
    const auto [dim, chunks] = it->second;
    auto slices = tp.all_gather(v.contiguous());  // by rank
    std::vector<at::Tensor> parts;
    for (int64_t c = 0; c < chunks; ++c) {
      for (const auto& s : slices) parts.push_back(s.chunk(chunks, dim)[static_cast<size_t>(c)]);
    }
    out[p.key()] = at::cat(parts, dim).cpu();
  }
  if (gradients) return out;
  for (const auto& b : module.named_buffers()) out[b.key()] = b.value().detach().cpu().clone();
  return out;
}

void load_full_state(torch::nn::Module& module, const Dist& tp,
                     const std::map<std::string, at::Tensor>& state) {
  const auto split = split_parameters(module);
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    auto it = state.find(p.key());
    if (it == state.end()) throw UsageError("load_full_state: no '" + p.key() + "' in the state");
    at::Tensor v = it->second;
    auto s = split.find(p.key());
    if (s != split.end() && tp.size() > 1) {
      v = split_of(v, s->second.dim, s->second.chunks, tp.rank(), tp.size());
    }
    if (v.sizes() != p.value().sizes()) {
      throw UsageError("load_full_state: '" + p.key() + "' is " + c10::str(it->second.sizes()) +
                       " in the state; this model's slice of it is " + c10::str(p.value().sizes()));
    }
    p.value().copy_(v);
  }
}

}  // namespace scaletrain
