#include "gpt.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <torch/nn/init.h>

#include <cmath>
#include <limits>
#include <optional>

#include "scaletrain/activation_checkpoint.h"
#include "scaletrain/blocks.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/coordinated_dropout.h"
#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"

namespace scaletrain {

// Note [Coordinated dropout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The GPT's dropouts are the library's coordinated_dropout() (coordinated_dropout.h): under a
// tensor-parallel plan every rank of the group draws the mask of the whole tensor, from a
// generator in the same state on each (the trainer seeds a group's ranks alike, Note [Rank
// streams] in src/train/rng.cpp), and keeps the part its slice holds: its heads of the attention
// probabilities, its slice of the sequence in the sequence-parallel regions (embeddings and
// residual branches), all of it where the tensor is replicated. So the masks are the unsplit
// model's whatever the degree, and a split GPT with dropout trains as the single process does.
// With dropout the attention runs as its three products (the probabilities' mask drawn by
// ContextParallelism::attention) instead of scaled_dot_product_attention, at every degree, so
// that degree 1 draws the same masks too. Under context parallelism each rank draws the whole
// masks too and keeps its positions' part: the ring's rows of the probabilities' mask (Note
// [Ring attention with dropout] in src/cp/ring_attention.cpp), the residuals' positions.

// What a GPT's layers share: the dropouts' probability, generator (unset: the device's default)
// and the rank's place in the tensor-parallel group; context parallelism's group and split.
struct LayerContext {
  double p = 0;
  std::optional<at::Generator> generator;
  int64_t rank = 0, size = 1;
  bool sequence_parallel = false;
  ContextParallelism cp;

  bool active(bool training) const { return training && p > 0; }
  // x's mask: the whole tensor's, cut to x's part along `dim`: part `rank` of `parts` (1: x is
  // the whole tensor).
  at::Tensor apply(const at::Tensor& x, int64_t dim, int64_t parts) const {
    return coordinated_dropout(x, {p, {dim, parts, parts > 1 ? rank : 0}, generator});
  }
  // A residual branch's or the embeddings' output [B, T, C]: a slice of the sequence under
  // sequence parallelism, else whole on every rank; under context parallelism, of the rank's
  // slice of it (its positions).
  at::Tensor residual(const at::Tensor& x, bool training) const {
    if (!active(training)) return x;
    const int64_t parts = sequence_parallel ? size : 1;
    if (!cp.on()) return apply(x, 1, parts);
    CoordinatedDropoutOptions o{p, {1, parts, parts > 1 ? rank : 0}, generator};
    o.length = x.size(1) * parts * cp.split.degree;
    o.positions = cp.split.positions(o.length);
    return coordinated_dropout(x, o);
  }
  // The attention probabilities' dropout [B, heads, T, T] (this rank's heads).
  AttentionDropout attention(bool training) const {
    if (!active(training)) return {};
    return {p, {1, size, size > 1 ? rank : 0}, generator};
  }
};

namespace {

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const GPTConfig& c, std::shared_ptr<const LayerContext> shared)
      : head_dim_(c.n_embd / c.n_head), shared_(std::move(shared)) {
    c_attn = register_module("c_attn", ParallelLinear(c.n_embd, 3 * c.n_embd));
    c_proj = register_module("c_proj", ParallelLinear(c.n_embd, c.n_embd));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto qkv = c_attn(x);  // [B, T, 3·C] (this rank's heads: 3·C/tp)
    const int64_t b = qkv.size(0);
    const int64_t t = qkv.size(1);
    auto parts = qkv.chunk(3, -1);
    auto heads = [&](const at::Tensor& p) { return p.view({b, t, -1, head_dim_}).transpose(1, 2); };
    auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    // Over the whole sequence (this rank's slice of it under context parallelism), with
    // dropout on this rank's heads' probabilities (Note [Coordinated dropout]).
    at::Tensor y = shared_->cp.attention(q, k, v, std::nullopt, shared_->attention(is_training()));
    y = y.transpose(1, 2).contiguous().view({b, t, -1});
    return shared_->residual(c_proj(y), is_training());
  }
  ParallelLinear c_attn{nullptr}, c_proj{nullptr};

 private:
  int64_t head_dim_;
  std::shared_ptr<const LayerContext> shared_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const GPTConfig& c, std::shared_ptr<const LayerContext> shared)
      : tanh_(c.gelu_tanh), shared_(std::move(shared)) {
    c_fc = register_module("c_fc", ParallelLinear(c.n_embd, 4 * c.n_embd));
    c_proj = register_module("c_proj", ParallelLinear(4 * c.n_embd, c.n_embd));
  }
  at::Tensor forward(const at::Tensor& x) {
    return shared_->residual(c_proj(at::gelu(c_fc(x), tanh_ ? "tanh" : "none")), is_training());
  }
  ParallelLinear c_fc{nullptr}, c_proj{nullptr};

 private:
  bool tanh_;
  std::shared_ptr<const LayerContext> shared_;
};
TORCH_MODULE(Mlp);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(const GPTConfig& c, const std::shared_ptr<const LayerContext>& shared,
                       int64_t layer)
      : shared_(shared) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    attn = register_module("attn", Attention(c, shared));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    if (c.moe.at(layer)) {
      moe = register_module("moe", MoE(c.moe.options(c.n_embd, 4 * c.n_embd, false)));
    } else {
      mlp = register_module("mlp", Mlp(c, shared));
    }
  }
  at::Tensor forward(at::Tensor x) {
    x = x + attn(ln_1(x));
    if (moe) return x + shared_->residual(moe(ln_2(x)), is_training());
    return x + mlp(ln_2(x));
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
  MoE moe{nullptr};

 private:
  std::shared_ptr<const LayerContext> shared_;
};
TORCH_MODULE(TransformerBlock);

}  // namespace

GPTConfig gpt_config(const std::string& name) {
  GPTConfig c;
  if (name == "gpt-tiny") return c;
  if (name == "gpt2-small") {
    c.vocab_size = 50257;
    c.block_size = 1024;
    c.n_layer = 12;
    c.n_head = 12;
    c.n_embd = 768;
    return c;
  }
  throw UsageError("unknown GPT size '" + name + "'; use gpt-tiny or gpt2-small");
}

int64_t gpt_flops_parameters(const GPTConfig& c) {
  const int64_t w = c.n_embd;
  // Per block: ln_1 and ln_2 (2·C each), c_attn (C·3C + 3C), attn.c_proj (C·C + C), mlp.c_fc
  // (C·4C + 4C), mlp.c_proj (4C·C + C): 12·C² + 13·C. Then ln_f (2·C) and the head (V·C).
  const int64_t block = 12 * w * w + 13 * w;
  int64_t n = c.n_layer * block + 2 * w + c.vocab_size * w;
  for (int64_t i = 0; i < c.n_layer; ++i) {  // a MoE layer: its router and k experts (no bias)
    if (c.moe.at(i)) n += c.moe.active_parameters(w, 8 * w * w) - (8 * w * w + 5 * w);
  }
  return n;
}

int64_t gpt_flops_per_token(const GPTConfig& c) {
  const int64_t head_dim = c.n_embd / c.n_head;
  return 6 * gpt_flops_parameters(c) + 12 * c.n_layer * c.n_head * head_dim * c.block_size;
}

GPTImpl::GPTImpl(const GPTConfig& c) : config_(c), shared_(std::make_shared<LayerContext>()) {
  shared_->p = c.dropout;
  if (c.n_head < 1 || c.n_embd % c.n_head != 0) {
    throw UsageError("GPT: the width " + std::to_string(c.n_embd) + " does not split into " +
                     std::to_string(c.n_head) + " heads; make it a multiple of the heads");
  }
  transformer_ = register_module("transformer", std::make_shared<torch::nn::Module>());
  wte_ = transformer_->register_module("wte", ParallelEmbedding(c.vocab_size, c.n_embd));
  wpe_ = transformer_->register_module("wpe", ParallelEmbedding(c.block_size, c.n_embd));
  h_ = transformer_->register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) h_->push_back(TransformerBlock(c, shared_, i));
  ln_f_ = transformer_->register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  if (!c.tied_head) {
    lm_head_ = register_module(
        "lm_head", ParallelLinear(ParallelLinearOptions(c.n_embd, c.vocab_size).bias(false)));
  }
  // GPT-2's initialisation: N(0, 0.02), zero biases, the projections into the residual scaled
  // by 1/sqrt(2·layers).
  torch::NoGradGuard no_grad;
  for (const auto& p : named_parameters()) {
    const std::string& n = p.key();
    if (n.find("ln_") != std::string::npos) continue;  // LayerNorm: ones and zeros
    if (n.size() >= 4 && n.compare(n.size() - 4, 4, "bias") == 0) {
      p.value().zero_();
    } else if (n.find("c_proj.weight") != std::string::npos ||
               n.find("moe.w2") != std::string::npos) {
      torch::nn::init::normal_(p.value(), 0.0, 0.02 / std::sqrt(2.0 * c.n_layer));
    } else {
      torch::nn::init::normal_(p.value(), 0.0, 0.02);
    }
  }
}

at::Tensor GPTImpl::forward(const at::Tensor& ids) {
  auto x = embed(ids);
  for (const auto& block : *h_) {
    auto* b = block->as<TransformerBlock>();
    x = config_.checkpoint_blocks && is_training()
            ? activation_checkpoint([b](const at::Tensor& in) { return b->forward(in); }, x)
            : b->forward(x);
  }
  return head(x);
}

at::Tensor GPTImpl::embed(const at::Tensor& ids) {
  if (ids.dim() != 2 || ids.size(1) > config_.block_size) {
    throw UsageError("GPT: token ids " + c10::str(ids.sizes()) +
                     ": it takes [batch, positions] of at most " +
                     std::to_string(config_.block_size) + " positions (its context)");
  }
  auto x = wte_(ids);  // [B, T, C], or this rank's slice of the positions
  const int64_t n = x.size(1);
  // Sequence parallelism's slice of the sequence, or of context parallelism's slice of it.
  const int64_t parts = tp_ && sequence_parallel_ ? tp_->size() : 1;
  const int64_t first = parts > 1 ? tp_->rank() * n : 0;
  auto pos = shared_->cp.positions(n * parts, ids.options()).narrow(0, first, n);
  return shared_->residual(x + wpe_(pos), is_training());
}

at::Tensor GPTImpl::head(at::Tensor x) {
  x = ln_f_(x);
  if (lm_head_) return lm_head_(x);  // colwise under a plan: it gathers or copies its input
  if (tp_) x = sequence_parallel_ ? gather_from_sequence(x, *tp_, 1) : copy_to_region(x, *tp_);
  return at::linear(x, wte_->weight);  // the head tied to the token embedding
}

torch::nn::Sequential GPTImpl::blocks() {
  if (config_.tied_head) {
    throw UsageError(
        "GPT: a tied LM head shares the token embedding's weight between the first and the last "
        "block, which pipeline stages and fsdp units cannot share; build the GPT with an untied "
        "head for them");
  }
  torch::nn::Sequential seq;
  auto self = std::static_pointer_cast<GPTImpl>(shared_from_this());
  seq->push_back("embed",
                 scaletrain::Block(BlockParts{{"wte", wte_.ptr()}, {"wpe", wpe_.ptr()}},
                                   [self](const at::Tensor& ids) { return self->embed(ids); }));
  for (size_t i = 0; i < h_->size(); ++i) {
    auto b = h_[i];
    seq->push_back("h" + std::to_string(i),
                   scaletrain::Block(BlockParts{{"block", b}}, [b](const at::Tensor& x) {
                     return b->as<TransformerBlock>()->forward(x);
                   }));
  }
  seq->push_back("head",
                 scaletrain::Block(BlockParts{{"ln_f", ln_f_.ptr()}, {"lm_head", lm_head_.ptr()}},
                                   [self](const at::Tensor& x) { return self->head(x); }));
  return seq;
}

at::Tensor GPTImpl::loss(const at::Tensor& logits, const at::Tensor& targets,
                         int64_t ignore_index) const {
  if (tp_) return vocab_parallel_cross_entropy(logits, targets, *tp_, ignore_index);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {},
                                at::Reduction::Mean, ignore_index);
}

TensorParallelPlan GPTImpl::plan(bool sp) const {
  TensorParallelPlan p;
  p["transformer.wte"] = vocab_parallel(sp);
  if (!config_.tied_head) p["lm_head"] = colwise(1, sp);
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    const std::string b = "transformer.h." + std::to_string(i) + ".";
    p[b + "attn.c_attn"] = colwise(3, sp);
    p[b + "attn.c_proj"] = rowwise(sp);
    if (config_.moe.at(i)) continue;  // a MoE layer: its experts whole on every tp rank
    p[b + "mlp.c_fc"] = colwise(1, sp);
    p[b + "mlp.c_proj"] = rowwise(sp);
  }
  return p;
}

void GPTImpl::parallelize(const Dist& tp, bool sp) {
  if (config_.n_head % tp.size() != 0) {
    throw UsageError("tensor parallelism: GPT's " + std::to_string(config_.n_head) +
                     " heads do not split over " + std::to_string(tp.size()) +
                     " ranks; use a degree that divides the heads");
  }
  parallelize_module(*this, tp, plan(sp));
  tp_ = std::make_shared<const Dist>(tp);
  sequence_parallel_ = sp;
  shared_->rank = tp.rank();
  shared_->size = tp.size();
  shared_->sequence_parallel = sp;
}

void GPTImpl::context_parallel(const Dist* cp, const ContextSplit& split) {
  shared_->cp.set(cp, split);
}

void GPTImpl::set_dropout_generator(at::Generator generator) {
  shared_->generator = std::move(generator);
}

}  // namespace scaletrain
