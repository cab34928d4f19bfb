// The mixture-of-experts layer and its router (expert_parallel.h); the dispatch is in
// dispatch.cpp.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <cmath>
#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"

#if __has_include(<ATen/ops/_grouped_mm.h>)
#include <ATen/ops/_grouped_mm.h>
#define SCALETRAIN_HAS_GROUPED_MM 1
#endif

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string str(int64_t v) { return std::to_string(v); }

// Leaves the layer's output as it is and adds `scale` times the gradient of the load-balancing
// loss in backward, as if scale · aux had been added to the loss (Megatron-Core's
// MoEAuxLossAutoScaler): the loss the trainer reports stays the model's.
struct AuxLossGradient : torch::autograd::Function<AuxLossGradient> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& aux,
                            double scale) {
    ctx->saved_data["one"] = at::full({}, scale, aux.options());
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {grad[0], ctx->saved_data.at("one").toTensor(), at::Tensor()};
  }
};

struct ShardGroup : torch::CustomClassHolder {
  std::shared_ptr<const Dist> edp;
  ExpertTraffic* traffic = nullptr;
};

// Note [Experts sharded over edp]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After shard_experts(), each of the M ranks of the edp group (the ranks that hold the same E'
// experts of the ep split) keeps E'/M of them: rank m experts [m · E'/M, (m + 1) · E'/M) of the
// E'. A forward puts the E' back together with one all-gather of the layer's shards, flat (w1,
// w2, w3 of this rank one after the other): what arrives is rank by rank, so each weight's part
// of every rank, in rank order, is the weight's experts in order. The backward is the mirror:
// each weight's gradient cut the same way, every rank's part laid out as its flat shard, and one
// reduce-scatter sums the M ranks' gradients (each from its own tokens) into each rank's part.
struct GatherExperts : torch::autograd::Function<GatherExperts> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w1, const at::Tensor& w2,
                               const at::Tensor& w3, c10::IValue held) {
    const ShardGroup& g = *static_cast<ShardGroup*>(held.toCapsule().get());
    ctx->saved_data["group"] = held;
    std::vector<at::Tensor> flat{w1.reshape({-1}), w2.reshape({-1})};
    if (w3.numel() > 0) flat.push_back(w3.reshape({-1}));
    if (g.traffic != nullptr) g.traffic->shard_exchanges += 1;
    const int64_t m = g.edp->size();
    const at::Tensor all =
        g.edp->all_gather_into_tensor(at::cat(flat), "the experts' shards").view({m, -1});
    variable_list out;
    int64_t at = 0;
    for (const at::Tensor& w : {w1, w2, w3}) {
      if (w.numel() == 0) continue;  // no w3 (GELU experts)
      auto shape = w.sizes().vec();
      shape[0] *= m;
      out.push_back(all.narrow(1, at, w.numel()).reshape(shape));
      at += w.numel();
    }
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const ShardGroup& g = *static_cast<ShardGroup*>(ctx->saved_data.at("group").toCapsule().get());
    const int64_t m = g.edp->size();
    std::vector<at::Tensor> parts;
    for (const at::Tensor& gw : grad) parts.push_back(gw.reshape({m, -1}));
    if (g.traffic != nullptr) g.traffic->shard_exchanges += 1;
    const at::Tensor mine = g.edp->reduce_scatter_tensor(at::cat(parts, 1).reshape({-1}),
                                                         ReduceOp::SUM, "the experts' gradients");
    variable_list out;
    int64_t at = 0;
    for (const at::Tensor& gw : grad) {
      const int64_t n = gw.numel() / m;
      auto shape = gw.sizes().vec();
      shape[0] /= m;
      out.push_back(mine.narrow(0, at, n).reshape(shape));
      at += n;
    }
    if (out.size() == 2) out.emplace_back();
    out.emplace_back();
    return out;
  }
};

// One expert's MLP on its rows.
at::Tensor expert_mlp(const at::Tensor& rows, const at::Tensor& w1, const at::Tensor& w2,
                      const at::Tensor& w3, bool swiglu) {
  at::Tensor h = at::matmul(rows, w1);
  h = swiglu ? at::silu(h) * at::matmul(rows, w3) : at::gelu(h);
  return at::matmul(h, w2);
}

}  // namespace

void MoEOptions::check() const {
  if (dim < 1 || hidden < 1 || experts < 1) {
    throw UsageError("MoE: dim, hidden and experts must be at least 1 (got " + str(dim) + ", " +
                     str(hidden) + ", " + str(experts) + ")");
  }
  if (top_k < 1 || top_k > experts) {
    throw UsageError("MoE: --top-k " + str(top_k) + " must be between 1 and the " + str(experts) +
                     " experts; route each token to at most as many experts as "
                     "there are");
  }
  if (!(aux_loss_coef >= 0) || !std::isfinite(aux_loss_coef)) {
    throw UsageError("MoE: the load-balancing loss coefficient " + std::to_string(aux_loss_coef) +
                     " must be a finite number ≥ 0 (0 turns it off)");
  }
}

Routing route(const at::Tensor& x, const at::Tensor& router, const MoEOptions& options) {
  const auto type = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
  const at::Tensor probs = at::softmax(at::linear(x, router), -1, type);
  Routing r;
  auto [top, ids] = at::topk(probs, options.top_k, -1);
  if (options.normalize_top_k && options.top_k > 1) top = top / top.sum(-1, true);
  r.expert_ids = ids;
  r.weights = top;
  r.tokens_per_expert = at::bincount(ids.reshape({-1}), {}, options.experts);
  const int64_t slots = ids.numel();
  if (options.aux_loss_coef > 0 && slots > 0) {
    const at::Tensor share = r.tokens_per_expert.to(type) / static_cast<double>(slots);
    r.aux_loss = (share * probs.mean(0)).sum() * static_cast<double>(options.experts);
  } else {
    r.aux_loss = at::zeros({}, probs.options());
  }
  return r;
}

MoEImpl::MoEImpl(const MoEOptions& o) : options(o) {
  options.check();
  reset();
}

void MoEImpl::reset() {
  // nn.Linear's default initialisation for each: uniform within ±1/sqrt(fan in).
  auto uniform = [](std::vector<int64_t> shape, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return at::empty(shape).uniform_(-bound, bound);
  };
  const int64_t e = options.experts, d = options.dim, h = options.hidden;
  router = register_parameter("router", uniform({e, d}, d));
  w1 = register_parameter("w1", uniform({e, d, h}, d));
  w2 = register_parameter("w2", uniform({e, h, d}, h));
  if (options.swiglu) w3 = register_parameter("w3", uniform({e, d, h}, d));
}

void MoEImpl::expert_parallel(const Dist* ep) {
  if (ep == nullptr || ep->size() == 1) {
    if (ep_) {
      throw UsageError("MoE: this layer holds " + str(local_experts()) + " of its " +
                       str(options.experts) +
                       " experts and cannot take them all back; build it "
                       "again and load a whole checkpoint");
    }
    return;
  }
  if (ep_) throw UsageError("MoE: the experts are already spread over an ep group");
  if (edp_) {
    throw UsageError(
        "MoE: the experts are sharded over an edp group already; call "
        "expert_parallel() before shard_experts()");
  }
  const int n = ep->size();
  if (options.experts % n != 0) {
    throw UsageError("MoE: " + str(options.experts) + " experts cannot be spread over --ep " +
                     str(n) + " ranks; use an ep degree that divides the experts (or " +
                     str(options.experts - options.experts % n + n) + " experts)");
  }
  const int64_t local = options.experts / n;
  first_ = ep->rank() * local;
  at::NoGradGuard no_grad;
  for (at::Tensor* w : {&w1, &w2, &w3}) {
    if (w->defined()) w->set_data(w->narrow(0, first_, local).clone());
  }
  ep_ = std::make_shared<const Dist>(*ep);
}

// Note [Experts sharded over edp].
void MoEImpl::shard_experts(const Dist* edp) {
  if (edp == nullptr || edp->size() == 1) return;
  if (edp_) throw UsageError("MoE: the experts are already sharded over an edp group");
  const int m = edp->size();
  const int64_t local = local_experts();
  if (local % m != 0) {
    throw UsageError("MoE: the " + str(local) +
                     " experts this rank computes cannot be sharded over " + str(m) +
                     " ranks; use an expert count or ep degree that leaves a multiple of " +
                     str(m) + " experts per ep rank, or keep the experts whole");
  }
  const int64_t held = local / m;
  at::NoGradGuard no_grad;
  for (at::Tensor* w : {&w1, &w2, &w3}) {
    if (w->defined()) w->set_data(w->narrow(0, edp->rank() * held, held).clone());
  }
  edp_ = std::make_shared<const Dist>(*edp);
}

at::Tensor MoEImpl::experts_forward(const Dispatched& d, const at::Tensor& w1, const at::Tensor& w2,
                                    const at::Tensor& w3) const {
#ifdef SCALETRAIN_HAS_GROUPED_MM
  // One grouped matmul per weight where the device has it (CUDA, bfloat16, rows of 16 bytes).
  if (d.rows.is_cuda() && d.rows.scalar_type() == at::kBFloat16 && options.dim % 8 == 0 &&
      options.hidden % 8 == 0) {
    const at::Tensor offsets =
        at::tensor(d.rows_per_expert, at::kLong).cumsum(0).to(at::kInt).to(d.rows.device());
    at::Tensor h = at::_grouped_mm(d.rows, w1, offsets);
    h = options.swiglu ? at::silu(h) * at::_grouped_mm(d.rows, w3, offsets) : at::gelu(h);
    return at::_grouped_mm(h, w2, offsets);
  }
#endif
  // Each weight unbound once: its experts' gradients come back as one stack, where w[e] would
  // fill a zero tensor of the whole weight per expert and add them up.
  std::vector<at::Tensor> outs;
  const auto parts = at::split_with_sizes(d.rows, d.rows_per_expert);
  const auto a = w1.unbind(0), b = w2.unbind(0);
  const auto c = options.swiglu ? w3.unbind(0) : std::vector<at::Tensor>(a.size());
  for (size_t e = 0; e < a.size(); ++e) {
    outs.push_back(expert_mlp(parts[e], a[e], b[e], c[e], options.swiglu));
  }
  return at::cat(outs);
}

at::Tensor MoEImpl::forward(const at::Tensor& input) {
  if (input.size(-1) != options.dim) {
    throw UsageError("MoE: input's last dimension is " + str(input.size(-1)) +
                     ", the layer's dim " + str(options.dim));
  }
  const at::Tensor x = input.reshape({-1, options.dim});
  Routing r = route(x, router, options);
  at::Tensor a = w1, b = w2, c = w3;
  if (edp_) {  // Note [Experts sharded over edp]
    auto held = c10::make_intrusive<ShardGroup>();
    held->edp = edp_;
    held->traffic = traffic;
    // Autograd wants a defined tensor for each input: an empty one stands for GELU's missing w3.
    auto full = GatherExperts::apply(w1, w2, w3.defined() ? w3 : at::empty({0}, w1.options()),
                                     c10::IValue::make_capsule(std::move(held)));
    a = full[0];
    b = full[1];
    if (full.size() > 2) c = full[2];
  }
  const Dispatched d = dispatch(x, r.expert_ids, options.experts, ep_.get(), traffic);
  at::Tensor out = combine(experts_forward(d, a, b, c), d, r.weights);
  if (options.aux_loss_coef > 0 && is_training() && at::GradMode::is_enabled()) {
    out = AuxLossGradient::apply(out, r.aux_loss, options.aux_loss_coef * aux_loss_scale);
  }
  last_aux_loss = r.aux_loss.detach();
  last_tokens_per_expert = r.tokens_per_expert;
  return out.reshape(input.sizes());
}

std::vector<MoEImpl*> moe_layers(torch::nn::Module& module) {
  std::vector<MoEImpl*> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* moe = dynamic_cast<MoEImpl*>(m.get())) out.push_back(moe);
  }
  return out;
}

}  // namespace scaletrain
