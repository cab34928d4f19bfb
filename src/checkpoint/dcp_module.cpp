// A whole model and its optimizer under the keys of Python's get_state_dict(model, optim), saved
// as dcp.save({"model": model_sd, "optim": optim_sd}) saves them (distributed_checkpoint.h).
// Python keeps an optimizer's state by parameter name and each group's hyperparameters as plain
// values; 2.11's groups hold these fields (Optimizer.param_groups after construction):
//
//   Adam, AdamW  lr betas eps weight_decay amsgrad maximize foreach capturable differentiable
//                fused decoupled_weight_decay params        state: step (float32, 0-d),
//                                                            exp_avg, exp_avg_sq[, max_exp_avg_sq]
//   SGD          lr momentum dampening weight_decay nesterov maximize foreach differentiable
//                fused params                                state: momentum_buffer (momentum != 0)
//
// LibTorch's options have the first fields of each; the rest are written with the values
// Python's constructor gives them (AdamW's decoupled_weight_decay True), so that dcp.load of a
// get_state_dict() finds every key it asks for. get_state_dict() of a Python optimizer that has
// not stepped initialises its state (zeros, after a step at lr 0); a LibTorch parameter without
// state is written the same way, as zeros, with step 0.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "checkpoint/optimizer_state.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using V = DcpValue;

std::vector<std::pair<std::string, at::Tensor>> model_tensors(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

// The name of each of the optimizer's parameters in `model`.
std::map<const void*, std::string> names_of(const torch::nn::Module& model,
                                            const torch::optim::Optimizer& opt) {
  std::map<const void*, std::string> names;
  for (const auto& p : model.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& params = opt.param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!names.count(params[i].unsafeGetTensorImpl())) {
        throw UsageError("parameter " + std::to_string(i) + " of the optimizer's group " +
                         std::to_string(g) +
                         " is not a parameter of the model; give the "
                         "optimizer the model's own parameters");
      }
    }
  }
  return names;
}

std::string kind_of(const torch::optim::Optimizer& opt) {
  const std::string kind = optimizer_kind(opt);
  if (kind.empty()) {
    throw UsageError(
        "a DCP checkpoint holds the state of torch::optim::SGD, Adam and AdamW under "
        "get_state_dict()'s names; this optimizer is of another type");
  }
  return kind;
}

// The hyperparameters of group `g` as Python 2.11 has them (the table above).
std::vector<std::pair<std::string, V>> group_fields(const torch::optim::OptimizerParamGroup& g,
                                                    const std::string& kind) {
  const V none{}, no = V::of(false);
  if (kind == "sgd") {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(g.options());
    return {{"lr", V::of(o.lr())},
            {"momentum", V::of(o.momentum())},
            {"dampening", V::of(o.dampening())},
            {"weight_decay", V::of(o.weight_decay())},
            {"nesterov", V::of(o.nesterov())},
            {"maximize", no},
            {"foreach", none},
            {"differentiable", no},
            {"fused", none}};
  }
  auto adam = [&](const auto& o, bool decoupled) -> std::vector<std::pair<std::string, V>> {
    const auto [b1, b2] = o.betas();
    return {{"lr", V::of(o.lr())},
            {"betas", V::tuple({V::of(b1), V::of(b2)})},
            {"eps", V::of(o.eps())},
            {"weight_decay", V::of(o.weight_decay())},
            {"amsgrad", V::of(o.amsgrad())},
            {"maximize", no},
            {"foreach", none},
            {"capturable", no},
            {"differentiable", no},
            {"fused", none},
            {"decoupled_weight_decay", V::of(decoupled)}};
  };
  if (kind == "adamw")
    return adam(static_cast<const torch::optim::AdamWOptions&>(g.options()), true);
  return adam(static_cast<const torch::optim::AdamOptions&>(g.options()), false);
}

bool amsgrad(const torch::optim::OptimizerParamGroup& g, const std::string& kind) {
  if (kind == "adamw") return static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad();
  if (kind == "adam") return static_cast<const torch::optim::AdamOptions&>(g.options()).amsgrad();
  return false;
}

// The state kinds a parameter of group `g` has in Python.
std::vector<std::string> state_kinds(const torch::optim::OptimizerParamGroup& g,
                                     const std::string& kind) {
  if (kind == "sgd") {
    if (static_cast<const torch::optim::SGDOptions&>(g.options()).momentum() == 0) return {};
    return {"momentum_buffer"};
  }
  std::vector<std::string> k = {"step", "exp_avg", "exp_avg_sq"};
  if (amsgrad(g, kind)) k.push_back("max_exp_avg_sq");
  return k;
}

TensorBox whole_box(DcpKey key, const at::Tensor& t) {
  return {std::move(key), t, t.sizes().vec(), {}};
}

void add_optimizer(DcpState& s, const torch::nn::Module& model,
                   const torch::optim::Optimizer& opt) {
  const std::string kind = kind_of(opt);
  const auto names = names_of(model, opt);
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& g = opt.param_groups()[gi];
    std::vector<V> params;
    for (const auto& p : g.params()) {
      const std::string& fqn = names.at(p.unsafeGetTensorImpl());
      params.push_back(V::of(fqn));
      const auto state = param_state(opt, p).value_or(ParamState{});
      for (const auto& k : state_kinds(g, kind)) {
        at::Tensor t = k == "step" ? at::scalar_tensor(static_cast<double>(state.step), at::kFloat)
                                   : at::Tensor();
        if (k != "step") {
          auto it = state.tensors.find(k);
          t = it != state.tensors.end() ? it->second.detach() : at::zeros_like(p).detach();
        }
        s.tensors.push_back(whole_box(dcp_optimizer_key(fqn, k), t));
      }
    }
    for (auto& [field, value] : group_fields(g, kind))
      s.values.emplace_back(dcp_param_group_key(static_cast<int>(gi), field), value);
    s.values.emplace_back(dcp_param_group_key(static_cast<int>(gi), "params"),
                          V::list(std::move(params)));
  }
}

}  // namespace

std::vector<std::pair<DcpKey, DcpValue>> dcp_optimizer_values(const torch::nn::Module& model,
                                                              const torch::optim::Optimizer& opt) {
  const std::string kind = kind_of(opt);
  const auto names = names_of(model, opt);
  std::vector<std::pair<DcpKey, DcpValue>> out;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& g = opt.param_groups()[gi];
    std::vector<V> params;
    for (const auto& p : g.params()) params.push_back(V::of(names.at(p.unsafeGetTensorImpl())));
    for (auto& [field, value] : group_fields(g, kind))
      out.emplace_back(dcp_param_group_key(static_cast<int>(gi), field), value);
    out.emplace_back(dcp_param_group_key(static_cast<int>(gi), "params"),
                     V::list(std::move(params)));
  }
  return out;
}

std::vector<std::string> dcp_optimizer_kinds(const torch::optim::Optimizer& opt) {
  if (opt.param_groups().empty()) return {};
  return state_kinds(opt.param_groups()[0], kind_of(opt));
}

DcpState dcp_module_state(const torch::nn::Module& model, const torch::optim::Optimizer* opt) {
  DcpState s;
  for (const auto& [fqn, t] : model_tensors(model))
    s.tensors.push_back(whole_box(dcp_model_key(fqn), t.detach()));
  if (opt) add_optimizer(s, model, *opt);
  return s;
}

void load_dcp_module_state(const std::string& dir, torch::nn::Module& model,
                           torch::optim::Optimizer* opt) {
  std::vector<TensorBox> boxes;
  for (const auto& [fqn, t] : model_tensors(model))
    boxes.push_back(whole_box(dcp_model_key(fqn), t.detach()));  // loaded in place
  const size_t model_boxes = boxes.size();
  std::string kind;
  std::vector<std::pair<at::Tensor, std::vector<std::string>>> wanted;  // param, its kinds
  if (opt) {
    kind = kind_of(*opt);
    const auto names = names_of(model, *opt);
    for (const auto& g : opt->param_groups()) {
      for (const auto& p : g.params()) {
        wanted.emplace_back(p, state_kinds(g, kind));
        for (const auto& k : wanted.back().second) {
          const at::Tensor t = k == "step" ? at::zeros({}, at::kDouble) : at::zeros_like(p);
          boxes.push_back(whole_box(dcp_optimizer_key(names.at(p.unsafeGetTensorImpl()), k), t));
        }
      }
    }
  }
  load_distributed_checkpoint(dir, boxes);  // checks every key before it copies any
  size_t next = model_boxes;
  for (const auto& [p, kinds] : wanted) {
    ParamState state;
    for (const auto& k : kinds) {
      const at::Tensor t = boxes[next++].tensor;
      if (k == "step") {
        state.step = static_cast<int64_t>(std::llround(t.item<double>()));
      } else {
        state.tensors[k] = t;
      }
    }
    if (!kinds.empty()) set_param_state(*opt, p, state);
  }
}

}  // namespace scaletrain
