// Note [Standard optimizer state] in optimizer_states.h.

#include "train/optimizer_states.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <set>

#include "scaletrain/error.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/zero.h"
#include "train/strategy.h"

namespace scaletrain {
namespace {

// The optimizer of `opt`'s kind and first group's options over `params`, or null.
std::unique_ptr<torch::optim::Optimizer> like(const torch::optim::Optimizer& opt,
                                              std::vector<at::Tensor> params) {
  if (opt.param_groups().size() != 1) return nullptr;
  const auto kind = optimizer_kind(opt);
  const auto& o = opt.param_groups()[0].options();
  using namespace torch::optim;
  if (kind == "sgd") return std::make_unique<SGD>(params, static_cast<const SGDOptions&>(o));
  if (kind == "adam") return std::make_unique<Adam>(params, static_cast<const AdamOptions&>(o));
  if (kind == "adamw") {
    return std::make_unique<AdamW>(params, static_cast<const AdamWOptions&>(o));
  }
  return nullptr;
}

// `module`'s parameter names by their TensorImpl.
std::map<const void*, std::string> names_of(torch::nn::Module& module) {
  std::map<const void*, std::string> out;
  for (const auto& p : module.named_parameters()) out[p.value().unsafeGetTensorImpl()] = p.key();
  return out;
}

// The module name of each parameter ZeRO shards, in ZeRO's order.
std::vector<std::pair<std::string, at::Tensor>> zero_order(const ShardedDataParallel& zero,
                                                           torch::nn::Module& module) {
  const auto names = names_of(module);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [zero_name, t] : zero.named_parameters()) {
    auto it = names.find(t.unsafeGetTensorImpl());
    if (it == names.end()) {
      throw Error("ZeRO shards a parameter '" + zero_name + "' that the module does not hold");
    }
    out.emplace_back(it->second, t);
  }
  return out;
}

// Each kind's tensors of `states`, by parameter name (for the per-kind collectives).
std::map<std::string, std::map<std::string, at::Tensor>> by_kind(const NamedStates& states) {
  std::map<std::string, std::map<std::string, at::Tensor>> out;
  for (const auto& [name, st] : states) {
    for (const auto& [kind, t] : st.tensors) out[kind][name] = t;
  }
  return out;
}

NamedStates from_kinds(const NamedStates& steps,
                       const std::map<std::string, std::map<std::string, at::Tensor>>& kinds) {
  NamedStates out;
  for (const auto& [name, st] : steps) out[name].step = st.step;
  for (const auto& [kind, tensors] : kinds) {
    for (const auto& [name, t] : tensors) out[name].tensors[kind] = t;
  }
  return out;
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> standard_optimizer(const torch::optim::Optimizer& opt,
                                                            torch::nn::Module& module,
                                                            const NamedStates& states) {
  auto out = like(opt, module.parameters());
  if (out && !states.empty()) set_named_states(*out, module, states);
  return out;
}

NamedStates named_states(const torch::optim::Optimizer& opt, torch::nn::Module& module) {
  NamedStates out;
  for (const auto& p : module.named_parameters()) {
    if (auto st = param_state(opt, p.value())) out[p.key()] = std::move(*st);
  }
  return out;
}

void set_named_states(torch::optim::Optimizer& opt, torch::nn::Module& module,
                      const NamedStates& states) {
  for (const auto& p : module.named_parameters()) {
    auto it = states.find(p.key());
    if (it == states.end()) continue;  // a parameter that never stepped
    ParamState st = it->second;
    for (auto& [kind, t] : st.tensors) {
      if (t.sizes() != p.value().sizes()) {
        throw UsageError("the optimizer state '" + kind + "' of '" + p.key() + "' is " +
                         c10::str(t.sizes()) + "; the parameter is " + c10::str(p.value().sizes()));
      }
      t = t.to(p.value().device());
    }
    set_param_state(opt, p.value(), st);
  }
}

NamedStates zero_named_states(const ShardedDataParallel& zero, const torch::optim::Optimizer& opt,
                              torch::nn::Module& module) {
  const auto full = zero.full_optimizer_state(opt);  // collective
  NamedStates out;
  if (full.empty()) return out;  // before the first step
  const int64_t step = full.count("step") ? full.at("step").item<int64_t>() : 0;
  int64_t offset = 0;
  for (const auto& [name, p] : zero_order(zero, module)) {
    ParamState& st = out[name];
    st.step = step;
    for (const auto& [kind, t] : full) {
      if (kind != "step") {
        st.tensors[kind] = t.narrow(0, offset, p.numel()).view(p.sizes()).to(p.device());
      }
    }
    offset += p.numel();
  }
  return out;
}

bool load_zero_named_states(ShardedDataParallel& zero, torch::optim::Optimizer& opt,
                            torch::nn::Module& module, const NamedStates& states) {
  std::map<std::string, std::vector<at::Tensor>> parts;
  std::map<std::string, at::Tensor> full;
  for (const auto& [name, p] : zero_order(zero, module)) {
    auto it = states.find(name);
    if (it == states.end()) return false;  // a parameter without state: the optimizer starts afresh
    full["step"] = at::scalar_tensor(static_cast<double>(it->second.step), at::kLong);
    for (const auto& [kind, t] : it->second.tensors) {
      if (t.numel() != p.numel()) {
        throw UsageError("the optimizer state '" + kind + "' of '" + name + "' holds " +
                         std::to_string(t.numel()) + " values; the parameter " +
                         std::to_string(p.numel()));
      }
      parts[kind].push_back(t.reshape({-1}).cpu());
    }
  }
  for (auto& [kind, v] : parts) full[kind] = at::cat(v);
  if (full.empty()) return false;
  zero.load_full_optimizer_state(opt, full);
  return true;
}

at::Tensor states_to_bytes(const NamedStates& states) {
  torch::serialize::OutputArchive ar;
  for (const auto& [name, st] : states) {
    ar.write(name + "#step", at::scalar_tensor(static_cast<double>(st.step), at::kLong), true);
    for (const auto& [kind, t] : st.tensors) ar.write(name + "#" + kind, t.detach().cpu(), true);
  }
  return archive_bytes(ar);
}

NamedStates states_from_bytes(const at::Tensor& bytes) {
  torch::serialize::InputArchive ar;
  load_archive_bytes(bytes, ar);
  NamedStates out;
  for (const auto& key : ar.keys()) {
    const auto mark = key.rfind('#');
    if (mark == std::string::npos) continue;
    at::Tensor t;
    ar.read(key, t, true);
    const std::string name = key.substr(0, mark), kind = key.substr(mark + 1);
    if (kind == "step") {
      out[name].step = t.item<int64_t>();
    } else {
      out[name].tensors[kind] = t;
    }
  }
  return out;
}

NamedStates join_states(torch::nn::Module& split, const Dist& tp, const NamedStates& mine) {
  auto kinds = by_kind(mine);
  for (auto& [kind, tensors] : kinds) tensors = gather_full_tensors(split, tp, tensors);
  return from_kinds(mine, kinds);
}

NamedStates slice_states(torch::nn::Module& split, const Dist& tp, const NamedStates& whole) {
  auto kinds = by_kind(whole);
  for (auto& [kind, tensors] : kinds) tensors = slice_full_state(split, tp, tensors);
  return from_kinds(whole, kinds);
}

}  // namespace scaletrain
