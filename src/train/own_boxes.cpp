// Note [Checkpoints every rank writes] in own_boxes.h.

#include "train/own_boxes.h"

#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "checkpoint/checkpoint_dcp.h"

namespace scaletrain {

OwnBoxes::OwnBoxes(torch::nn::Module& module, const Dist* tp, const torch::optim::Optimizer& opt)
    : kinds_(dcp_optimizer_kinds(opt)) {
  if (tp) {
    placements_ = slice_placements(module, *tp);
    return;
  }
  for (const auto& p : module.named_parameters()) {
    const auto shape = p.value().sizes().vec();
    placements_[p.key()] = {shape, {{whole(shape), std::vector<int64_t>(shape.size(), 0)}}};
  }
}

void OwnBoxes::add(const std::string& name, const Box& region, const at::Tensor& weight,
                   const ParamState& state) {
  for (const auto& k : kinds_) {
    if (k == "step") {
      if (stepped_.insert(name).second) {
        out_.tensors.push_back({dcp_optimizer_key(name, k),
                                at::scalar_tensor(static_cast<double>(state.step), at::kFloat),
                                {},
                                {}});
      }
      continue;
    }
    auto it = state.tensors.find(k);
    put(dcp_optimizer_key(name, k), name, region,
        it != state.tensors.end() ? it->second.detach().view(region.sizes)
                                  : at::zeros(region.sizes, weight.options()));
  }
  put(dcp_model_key(name), name, region, weight.detach());
}

// Each piece of the placement that the region meets: that part of the values, at its place in
// the whole parameter.
void OwnBoxes::put(const DcpKey& key, const std::string& name, const Box& region,
                   const at::Tensor& values) {
  const SlicePlacement& place = placements_.at(name);
  for (const auto& piece : place.pieces) {
    bool empty = false;
    std::vector<int64_t> offsets(region.sizes.size());
    at::Tensor part = values;
    for (size_t d = 0; d < region.sizes.size(); ++d) {
      const int64_t lo = std::max(region.offsets[d], piece.local.offsets[d]);
      const int64_t hi = std::min(region.offsets[d] + region.sizes[d],
                                  piece.local.offsets[d] + piece.local.sizes[d]);
      if (hi <= lo) {
        empty = true;
        break;
      }
      part = part.narrow(static_cast<int64_t>(d), lo - region.offsets[d], hi - lo);
      offsets[d] = piece.global_offsets[d] + lo - piece.local.offsets[d];
    }
    if (!empty) out_.tensors.push_back({key, part, place.whole_shape, offsets});
  }
}

void OwnBoxes::add_buffers(torch::nn::Module& module) {
  for (const auto& b : module.named_buffers()) add_buffer(b.key(), b.value());
}

void OwnBoxes::add_buffer(const std::string& name, const at::Tensor& value) {
  const at::Tensor v = value.detach();
  out_.tensors.push_back({dcp_model_key(name), v, v.sizes().vec(), {}});
}

bool writes_own_boxes(const torch::optim::Optimizer& opt) {
  return !optimizer_kind(opt).empty() && opt.param_groups().size() == 1;
}

}  // namespace scaletrain
