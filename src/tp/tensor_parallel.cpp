// Tensor and sequence parallelism (tensor_parallel.h): the conjugate operators as autograd
// functions, the split layers, the plan and the vocabulary-parallel loss (the gathered state:
// full_state.cpp).

#include "scaletrain/tensor_parallel.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "scaletrain/error.h"
#include "tp/split.h"

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A Dist carried through an autograd context (its saved_data holds IValues only).
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(Dist d) : dist(std::move(d)) {}
  Dist dist;
};
c10::IValue hold(const Dist& d) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(d));
}
const Dist& held(AutogradContext* ctx) {
  return static_cast<GroupHolder*>(ctx->saved_data.at("tp").toCapsule().get())->dist;
}

int64_t wrap_dim(int64_t dim, const at::Tensor& x) {
  const int64_t n = x.dim();
  const int64_t d = dim < 0 ? dim + n : dim;
  if (d < 0 || d >= n) {
    throw UsageError("dimension " + std::to_string(dim) + " of a " + c10::str(x.sizes()) +
                     " tensor does not exist");
  }
  return d;
}

at::Tensor summed(const at::Tensor& x, const Dist& tp) {
  at::Tensor t = x.contiguous().clone();
  if (tp.size() > 1) tp.all_reduce(t);
  return t;
}

at::Tensor gathered(const at::Tensor& x, const Dist& tp, int64_t dim) {
  if (tp.size() == 1) return x;
  const int64_t d = wrap_dim(dim, x);
  auto all = tp.all_gather_into_tensor(x.movedim(d, 0).contiguous());
  return all.movedim(0, d);
}

at::Tensor scattered_sum(const at::Tensor& x, const Dist& tp, int64_t dim) {
  const int64_t d = wrap_dim(dim, x);
  if (x.size(d) % tp.size() != 0) {
    throw UsageError("sequence parallelism: dimension " + std::to_string(dim) + " of a " +
                     c10::str(x.sizes()) + " tensor does not split into " +
                     std::to_string(tp.size()) +
                     " equal slices; make the sequence length a multiple of the tensor-parallel "
                     "degree");
  }
  if (tp.size() == 1) return x.contiguous().clone();
  auto mine = tp.reduce_scatter_tensor(x.movedim(d, 0).contiguous());
  return mine.movedim(0, d);
}

at::Tensor slice_of(const at::Tensor& x, const Dist& tp, int64_t dim) {
  const int64_t d = wrap_dim(dim, x);
  if (x.size(d) % tp.size() != 0) {
    throw UsageError("sequence parallelism: dimension " + std::to_string(dim) + " of a " +
                     c10::str(x.sizes()) + " tensor does not split into " +
                     std::to_string(tp.size()) + " equal slices");
  }
  const int64_t n = x.size(d) / tp.size();
  return x.narrow(d, tp.rank() * n, n).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue tp) {
    ctx->saved_data["tp"] = std::move(tp);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {summed(g[0], held(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, c10::IValue tp) {
    return summed(x, static_cast<GroupHolder*>(tp.toCapsule().get())->dist);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue tp,
                            int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return gathered(x, static_cast<GroupHolder*>(tp.toCapsule().get())->dist, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {scattered_sum(g[0], held(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue tp,
                            int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return scattered_sum(x, static_cast<GroupHolder*>(tp.toCapsule().get())->dist, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gathered(g[0].contiguous(), held(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue tp,
                            int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return slice_of(x, static_cast<GroupHolder*>(tp.toCapsule().get())->dist, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gathered(g[0].contiguous(), held(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue tp,
                            int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return gathered(x, static_cast<GroupHolder*>(tp.toCapsule().get())->dist, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {slice_of(g[0], held(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

// Note [Vocabulary-parallel cross entropy]. With z the logits of one token over the whole
// vocabulary and t its target: loss = log Σ_v exp(z_v − m) − (z_t − m) for any m. Each rank holds
// a slice of z: the maximum m (for the exponentials' range), Σ exp and z_t (found on the one rank
// whose slice holds t, zero elsewhere) are each one all-reduce of a number per token. The
// gradient, softmax(z) − onehot(t), is computed on each slice from the saved exponentials.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, c10::IValue tp, int64_t ignore_index) {
    const Dist& g = static_cast<GroupHolder*>(tp.toCapsule().get())->dist;
    const int64_t vl = logits.size(-1);
    const int64_t lo = static_cast<int64_t>(g.rank()) * vl;
    auto z = logits.reshape({-1, vl});
    auto t = targets.reshape({-1});
    auto valid = t != ignore_index;
    auto bad = valid & ((t < 0) | (t >= vl * g.size()));
    if (bad.any().item<bool>()) {
      const int64_t at = bad.nonzero()[0][0].item<int64_t>();
      throw Error("cross entropy: target " + std::to_string(t[at].item<int64_t>()) + " of token " +
                  std::to_string(at) + " is outside the vocabulary [0, " +
                  std::to_string(vl * g.size()) + ") (ignore_index is " +
                  std::to_string(ignore_index) + ")");
    }
    at::Tensor m = std::get<0>(z.detach().max(-1)).contiguous();
    if (g.size() > 1) g.all_reduce(m, ReduceOp::MAX);
    auto shifted = z - m.unsqueeze(1);
    auto e = shifted.exp();
    at::Tensor sum = e.sum(-1).contiguous();
    if (g.size() > 1) g.all_reduce(sum);
    auto local = valid & (t >= lo) & (t < lo + vl);
    auto idx = at::where(local, t - lo, at::zeros_like(t)).unsqueeze(1);
    at::Tensor picked =
        at::where(local, shifted.gather(1, idx).squeeze(1), at::zeros_like(m)).contiguous();
    if (g.size() > 1) g.all_reduce(picked);
    auto per_token = at::where(valid, sum.log() - picked, at::zeros_like(m));
    auto count = valid.sum().to(z.scalar_type());
    ctx->save_for_backward({e / sum.unsqueeze(1), idx, local, valid, count});
    ctx->saved_data["sizes"] = logits.sizes().vec();
    return per_token.sum() / count;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto s = ctx->get_saved_variables();
    auto g = s[0].clone();  // softmax of the slice
    g.scatter_add_(1, s[1], -s[2].unsqueeze(1).to(g.scalar_type()));
    g.mul_((s[3].to(g.scalar_type()) / s[4]).unsqueeze(1) * grad[0]);
    return {g.view(ctx->saved_data["sizes"].toIntVector()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

void require_divides(int64_t size, int64_t by, const std::string& what, const std::string& name,
                     const std::string& fix) {
  if (size % by != 0) {
    throw UsageError("tensor parallelism: " + (name.empty() ? std::string("a layer") : name) +
                     "'s " + what + " (" + std::to_string(size) + ") does not divide by " +
                     std::to_string(by) + "; " + fix);
  }
}

}  // namespace

// split.h: the slice of `full` that rank `rank` of `ranks` holds along `dim`.
at::Tensor split_of(const at::Tensor& full, int64_t dim, int64_t chunks, int rank, int ranks) {
  std::vector<at::Tensor> mine;
  for (const auto& part : full.chunk(chunks, dim)) {
    const int64_t n = part.size(dim) / ranks;
    mine.push_back(part.narrow(dim, rank * n, n));
  }
  return at::cat(mine, dim).contiguous();
}

at::Tensor copy_to_region(const at::Tensor& x, const Dist& tp) {
  return CopyToRegion::apply(x, hold(tp));
}
at::Tensor reduce_from_region(const at::Tensor& x, const Dist& tp) {
  return ReduceFromRegion::apply(x, hold(tp));
}
at::Tensor gather_from_sequence(const at::Tensor& x, const Dist& tp, int64_t dim) {
  return GatherFromSequence::apply(x, hold(tp), dim);
}
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const Dist& tp, int64_t dim) {
  return ReduceScatterToSequence::apply(x, hold(tp), dim);
}
at::Tensor scatter_to_sequence(const at::Tensor& x, const Dist& tp, int64_t dim) {
  return ScatterToSequence::apply(x, hold(tp), dim);
}
at::Tensor gather_from_region(const at::Tensor& x, const Dist& tp, int64_t dim) {
  return GatherFromRegion::apply(x, hold(tp), dim);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const Dist& tp, int64_t ignore_index) {
  if (logits.dim() != targets.dim() + 1 ||
      logits.sizes().slice(0, targets.dim()) != targets.sizes()) {
    throw UsageError("cross entropy: logits " + c10::str(logits.sizes()) + " against targets " +
                     c10::str(targets.sizes()) +
                     ": the logits need the targets' sizes and one more, the vocabulary slice");
  }
  return VocabParallelCrossEntropy::apply(logits, targets, hold(tp), ignore_index);
}

ParallelStyle colwise(int64_t chunks, bool sequence_parallel) {
  ParallelStyle s;
  s.kind = ParallelStyle::Kind::kColwise;
  s.chunks = chunks;
  s.sequence_parallel = sequence_parallel;
  return s;
}
ParallelStyle rowwise(bool sequence_parallel) {
  ParallelStyle s;
  s.kind = ParallelStyle::Kind::kRowwise;
  s.sequence_parallel = sequence_parallel;
  return s;
}
ParallelStyle vocab_parallel(bool sequence_parallel) {
  ParallelStyle s;
  s.kind = ParallelStyle::Kind::kVocab;
  s.sequence_parallel = sequence_parallel;
  return s;
}

// ---- ParallelLinear --------------------------------------------------------------------------

ParallelLinearImpl::ParallelLinearImpl(const ParallelLinearOptions& o) : options(o) { reset(); }

void ParallelLinearImpl::reset() {
  weight = register_parameter("weight", at::empty({options.out_features, options.in_features}));
  if (options.with_bias) {
    bias = register_parameter("bias", at::empty({options.out_features}));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  // torch.nn.Linear's initialisation.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = options.in_features > 0 ? 1.0 / std::sqrt(options.in_features) : 0;
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

at::Tensor ParallelLinearImpl::forward(const at::Tensor& x) {
  using K = ParallelStyle::Kind;
  if (!tp_ || style_.kind == K::kReplicate) return at::linear(x, weight, bias);
  const Dist& tp = *tp_;
  if (style_.kind == K::kColwise) {
    auto in = style_.sequence_parallel ? gather_from_sequence(x, tp, style_.sequence_dim)
                                       : copy_to_region(x, tp);
    auto y = at::linear(in, weight, bias);
    return style_.gather_output ? gather_from_region(y, tp, -1) : y;
  }
  auto partial = at::linear(x, weight);
  auto y = style_.sequence_parallel ? reduce_scatter_to_sequence(partial, tp, style_.sequence_dim)
                                    : reduce_from_region(partial, tp);
  return bias.defined() ? y + bias : y;
}

void ParallelLinearImpl::parallelize(const Dist& tp, const ParallelStyle& style,
                                     const std::string& name) {
  using K = ParallelStyle::Kind;
  const std::string who = name.empty() ? "a ParallelLinear" : "'" + name + "'";
  if (tp_) throw UsageError("tensor parallelism: " + who + " is split already");
  if (style.kind == K::kVocab) {
    throw UsageError("tensor parallelism: " + who +
                     " is a Linear; vocab_parallel() is for a ParallelEmbedding (use colwise() "
                     "to split a Linear's outputs over the vocabulary)");
  }
  if (style.chunks < 1) throw UsageError("tensor parallelism: chunks must be at least 1");
  if (style.kind == K::kColwise && style.chunks > 1 && style.gather_output) {
    throw UsageError("tensor parallelism: " + who +
                     ": gather_output with chunks > 1 would interleave the chunks; keep the "
                     "output split");
  }
  style_ = style;
  if (style.kind == K::kReplicate) return;
  const int n = tp.size();
  const int r = tp.rank();
  torch::NoGradGuard no_grad;
  if (style.kind == K::kColwise) {
    require_divides(options.out_features, style.chunks * n, "output features", name,
                    "make them a multiple of the degree (times the chunks)");
    weight.set_data(split_of(weight.detach(), 0, style.chunks, r, n));
    stop_summing_partial_gradients(weight);
    if (bias.defined()) {
      bias.set_data(split_of(bias.detach(), 0, style.chunks, r, n));
      stop_summing_partial_gradients(bias);
    }
  } else {
    require_divides(options.in_features, n, "input features", name,
                    "make them a multiple of the degree");
    weight.set_data(split_of(weight.detach(), 1, 1, r, n));
    stop_summing_partial_gradients(weight);
  }
  tp_ = std::make_shared<const Dist>(tp);
}

// ---- ParallelEmbedding -----------------------------------------------------------------------

ParallelEmbeddingImpl::ParallelEmbeddingImpl(int64_t n, int64_t d) : num_embeddings(n), dim(d) {
  reset();
}

void ParallelEmbeddingImpl::reset() {
  weight = register_parameter("weight", at::empty({num_embeddings, dim}));
  torch::nn::init::normal_(weight);
}

at::Tensor ParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (!tp_ || style_.kind != ParallelStyle::Kind::kVocab) return at::embedding(weight, ids);
  const int64_t n = weight.size(0);
  auto local = (ids >= first_id_) & (ids < first_id_ + n);
  auto idx = at::where(local, ids - first_id_, at::zeros_like(ids));
  auto out = at::embedding(weight, idx) * local.unsqueeze(-1).to(weight.scalar_type());
  return style_.sequence_parallel ? reduce_scatter_to_sequence(out, *tp_, style_.sequence_dim)
                                  : reduce_from_region(out, *tp_);
}

void ParallelEmbeddingImpl::parallelize(const Dist& tp, const ParallelStyle& style,
                                        const std::string& name) {
  const std::string who = name.empty() ? "a ParallelEmbedding" : "'" + name + "'";
  if (tp_) throw UsageError("tensor parallelism: " + who + " is split already");
  if (style.kind != ParallelStyle::Kind::kVocab && style.kind != ParallelStyle::Kind::kReplicate) {
    throw UsageError("tensor parallelism: " + who +
                     " is an Embedding: give it vocab_parallel() (colwise() and rowwise() are "
                     "for a ParallelLinear)");
  }
  style_ = style;
  if (style.kind == ParallelStyle::Kind::kReplicate) return;
  require_divides(num_embeddings, tp.size(), "vocabulary", name,
                  "pad it to a multiple of the degree (GPT-2's 50257 to 50304)");
  torch::NoGradGuard no_grad;
  first_id_ = num_embeddings / tp.size() * tp.rank();
  weight.set_data(split_of(weight.detach(), 0, 1, tp.rank(), tp.size()));
  stop_summing_partial_gradients(weight);
  tp_ = std::make_shared<const Dist>(tp);
}

// ---- The plan --------------------------------------------------------------------------------

void parallelize_module(torch::nn::Module& module, const Dist& tp, const TensorParallelPlan& plan) {
  require_joined(tp, "parallelize_module");
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_name;
  for (const auto& item : module.named_modules()) by_name[item.key()] = item.value();
  for (const auto& [name, style] : plan) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw UsageError("tensor parallel plan: '" + name +
                       "' is not a submodule of the model (names as named_modules() gives "
                       "them, e.g. 'blocks.0.attn.qkv')");
    }
    if (auto* l = dynamic_cast<ParallelLinearImpl*>(it->second.get())) {
      l->parallelize(tp, style, name);
    } else if (auto* e = dynamic_cast<ParallelEmbeddingImpl*>(it->second.get())) {
      e->parallelize(tp, style, name);
    } else {
      throw UsageError("tensor parallel plan: '" + name + "' is a " + it->second->name() +
                       "; only a scaletrain::ParallelLinear or ParallelEmbedding can be split "
                       "(declare it as one: same parameters, same function)");
    }
  }
  // Note [Partial gradients summed in backward] in sequence_parallel.cpp.
  const bool sequence_parallel = std::any_of(
      plan.begin(), plan.end(), [](const auto& entry) { return entry.second.sequence_parallel; });
  if (sequence_parallel) sum_partial_gradients(replicated_parameters(module), tp);
}

}  // namespace scaletrain
