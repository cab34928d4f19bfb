#include "scaletrain/blocks.h"

#include <ATen/ops/equal.h>

#include <map>

#include "scaletrain/error.h"

namespace scaletrain {

BlockImpl::BlockImpl(const BlockParts& parts, std::function<at::Tensor(const at::Tensor&)> fn)
    : fn_(std::move(fn)) {
  for (const auto& [name, m] : parts) {
    if (!m) throw UsageError("Block: part '" + name + "' is null");
    register_module(name, m);
  }
}

void check_chain(const torch::nn::Module& model, torch::nn::Sequential chain,
                 const std::function<at::Tensor(const at::Tensor&)>& model_forward,
                 const at::Tensor& sample) {
  std::map<const void*, std::string> own;  // the model's parameter storage -> its name
  for (const auto& p : model.named_parameters()) own[p.value().data_ptr()] = p.key();
  std::map<const void*, std::string> seen;
  for (const auto& p : chain->named_parameters()) {
    auto it = own.find(p.value().data_ptr());
    if (it == own.end()) {
      throw UsageError("the chain's parameter '" + p.key() +
                       "' is not one of the model's tensors (a copy, or a module the model does "
                       "not hold): register the model's own submodule in the block");
    }
    seen.emplace(it->first, it->second);
  }
  for (const auto& p : model.named_parameters()) {  // the first missing, in the model's order
    if (!seen.count(p.value().data_ptr())) {
      throw UsageError("the model's parameter '" + p.key() +
                       "' is in no block of the chain: register its module in the block that "
                       "uses it");
    }
  }
  at::NoGradGuard no_grad;
  const at::Tensor want = model_forward(sample);
  const at::Tensor got = chain->forward(sample);
  if (got.sizes() != want.sizes() || !at::equal(got, want)) {
    throw UsageError(
        "the chain computes another function than the model: output " + c10::str(got.sizes()) +
        " against " + c10::str(want.sizes()) +
        (got.sizes() == want.sizes()
             ? ", largest difference " + std::to_string((got - want).abs().max().item<double>())
             : std::string()) +
        "; check each block's function against the model's forward");
  }
}

}  // namespace scaletrain
