#include "checkpoint/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

template <typename S>
void put(std::map<std::string, at::Tensor>& m, const std::string& name, const at::Tensor& t) {
  if (t.defined()) m[name] = t;
}

template <typename S>
ParamState adam_like(const S& s) {
  ParamState out;
  out.step = s.step();
  put<S>(out.tensors, "exp_avg", s.exp_avg());
  put<S>(out.tensors, "exp_avg_sq", s.exp_avg_sq());
  put<S>(out.tensors, "max_exp_avg_sq", s.max_exp_avg_sq());
  return out;
}

at::Tensor get(const ParamState& s, const std::string& name) {
  auto it = s.tensors.find(name);
  return it == s.tensors.end() ? at::Tensor() : it->second;
}

template <typename S>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_like(const ParamState& s) {
  auto out = std::make_unique<S>();
  out->step(s.step);
  out->exp_avg(get(s, "exp_avg"));
  out->exp_avg_sq(get(s, "exp_avg_sq"));
  out->max_exp_avg_sq(get(s, "max_exp_avg_sq"));
  return out;
}

}  // namespace

std::string optimizer_kind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "sgd";
  return "";
}

std::optional<ParamState> param_state(const torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end() || !it->second) return std::nullopt;
  const auto* base = it->second.get();
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(base)) return adam_like(*s);
  if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(base)) return adam_like(*s);
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(base)) {
    ParamState out;
    put<torch::optim::SGDParamState>(out.tensors, "momentum_buffer", s->momentum_buffer());
    return out;
  }
  return std::nullopt;
}

void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& p, const ParamState& state) {
  const auto kind = optimizer_kind(opt);
  std::unique_ptr<torch::optim::OptimizerParamState> s;
  if (kind == "adamw") {
    s = make_adam_like<torch::optim::AdamWParamState>(state);
  } else if (kind == "adam") {
    s = make_adam_like<torch::optim::AdamParamState>(state);
  } else if (kind == "sgd") {
    auto sgd = std::make_unique<torch::optim::SGDParamState>();
    sgd->momentum_buffer(get(state, "momentum_buffer"));
    s = std::move(sgd);
  } else {
    throw UsageError(
        "sharded checkpoints hold the state of torch::optim::SGD, Adam and AdamW; this "
        "optimizer is of another type (save its state yourself, in TrainingState::tensors)");
  }
  opt.state()[p.unsafeGetTensorImpl()] = std::move(s);
}

}  // namespace scaletrain
