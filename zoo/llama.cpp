#include "llama.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <torch/nn/init.h>

#include <cmath>

#include "scaletrain/activation_checkpoint.h"
#include "scaletrain/blocks.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"

namespace scaletrain {

// Note [Llama as Hugging Face computes it]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each piece runs the operations of transformers' modeling_llama.py in their order, so that the
// same weights give the same logits to fp32 rounding (tests/llama_test.cpp compares them):
//   - RMSNorm: in fp32, x · rsqrt(mean(x²) + eps), cast back, times the weight;
//   - rotary embeddings: inv_freq = 1 / theta^(2i/d) (fp32), angles = position · inv_freq (one
//     product each, as Hugging Face's matmul of a column by a row), the angles twice over the
//     head's width, and q · cos + rotate_half(q) · sin with rotate_half(x) = (−x₂, x₁), the
//     halves of the head's width (not interleaved pairs: Hugging Face's layout);
//   - attention: scaled_dot_product_attention, causal, scale d^-½, the key/value heads shared by
//     n_heads / n_kv_heads query heads each (enable_gqa, Hugging Face's repeat_kv);
//   - the MLP: down(silu(gate(x)) · up(x)).

namespace {

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t width, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({width}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto h = x.to(at::kFloat);
    const auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
    return weight * (h * at::rsqrt(variance + eps_)).to(x.scalar_type());
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& c, std::shared_ptr<const ContextParallelism> cp)
      : c_(c), cp_(std::move(cp)) {
    const int64_t d = c.dim();
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      return register_module(name, ParallelLinear(ParallelLinearOptions(in, out).bias(false)));
    };
    q_proj = linear("q_proj", c.hidden_size, c.n_heads * d);
    k_proj = linear("k_proj", c.hidden_size, c.n_kv_heads * d);
    v_proj = linear("v_proj", c.hidden_size, c.n_kv_heads * d);
    o_proj = linear("o_proj", c.n_heads * d, c.hidden_size);
  }
  // x [B, T, C] (the whole sequence: a colwise layer gathers a sequence-parallel slice).
  at::Tensor forward(const at::Tensor& x) {
    const int64_t d = c_.dim();
    auto heads = [&](const at::Tensor& p, int64_t b, int64_t t) {
      return p.view({b, t, -1, d}).transpose(1, 2);  // [B, heads, T, d]
    };
    auto q = q_proj(x);
    const int64_t b = q.size(0), t = q.size(1);
    q = heads(q, b, t);
    auto k = heads(k_proj(x), b, t), v = heads(v_proj(x), b, t);
    const auto [cos, sin] = rotary(t, q);  // at the tokens' true positions
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    // Over the whole sequence: ring attention under context parallelism.
    auto y = cp_->attention(q, k, v, std::pow(static_cast<double>(d), -0.5));
    return o_proj(y.transpose(1, 2).reshape({b, t, -1}));
  }
  ParallelLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  // cos and sin [1, 1, T, d] in q's dtype.
  std::pair<at::Tensor, at::Tensor> rotary(int64_t t, const at::Tensor& q) const {
    const int64_t d = c_.dim();
    const auto [cos, sin] = llama_rotary_at(cp_->positions(t, q.options()), d, c_.rope_theta);
    return {cos.to(q.scalar_type()).view({1, 1, t, d}), sin.to(q.scalar_type()).view({1, 1, t, d})};
  }
  LlamaConfig c_;
  std::shared_ptr<const ContextParallelism> cp_;  // the model's
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  explicit LlamaMlpImpl(const LlamaConfig& c) {
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      return register_module(name, ParallelLinear(ParallelLinearOptions(in, out).bias(false)));
    };
    gate_proj = linear("gate_proj", c.hidden_size, c.intermediate_size);
    up_proj = linear("up_proj", c.hidden_size, c.intermediate_size);
    down_proj = linear("down_proj", c.intermediate_size, c.hidden_size);
  }
  at::Tensor forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }
  ParallelLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const LlamaConfig& c, const std::shared_ptr<const ContextParallelism>& cp,
                 int64_t layer) {
    input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    self_attn = register_module("self_attn", LlamaAttention(c, cp));
    post_attention_layernorm =
        register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    if (c.moe.at(layer)) {
      moe = register_module("moe", MoE(c.moe.options(c.hidden_size, c.intermediate_size, true)));
    } else {
      mlp = register_module("mlp", LlamaMlp(c));
    }
  }
  at::Tensor forward(at::Tensor x) {
    x = x + self_attn(input_layernorm(x));
    const at::Tensor h = post_attention_layernorm(x);
    return x + (moe ? moe(h) : mlp(h));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(LlamaLayer);

void check_shape(const LlamaConfig& c) {
  const bool ok = c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0 &&
                  (c.head_dim > 0 || c.hidden_size % c.n_heads == 0) && c.dim() % 2 == 0;
  if (!ok) {
    throw UsageError("Llama: " + std::to_string(c.n_heads) + " heads over " +
                     std::to_string(c.n_kv_heads) + " key/value heads, width " +
                     std::to_string(c.hidden_size) +
                     ": the key/value heads must divide the heads, the heads the width (or "
                     "head_dim be given), and each head's width be even (rotary pairs)");
  }
}

}  // namespace

std::pair<at::Tensor, at::Tensor> llama_rotary(int64_t t, int64_t d, double theta,
                                               const at::TensorOptions& options) {
  return llama_rotary_at(at::arange(t, options.dtype(at::kLong)), d, theta);
}

std::pair<at::Tensor, at::Tensor> llama_rotary_at(const at::Tensor& positions, int64_t d,
                                                  double theta) {
  const auto longs = positions.options().dtype(at::kLong);
  const auto exponents = at::arange(0, d, 2, longs).to(at::kFloat) / static_cast<double>(d);
  const auto inv_freq = at::reciprocal(at::pow(theta, exponents));
  // [t, d/2]: one product each (positions below 2^24 are exact in fp32)
  const auto angles = at::outer(positions.to(at::kFloat), inv_freq);
  const auto both = at::cat({angles, angles}, -1);
  return {both.cos(), both.sin()};
}

LlamaConfig llama_config(const std::string& name) {
  if (name == "llama-tiny") return LlamaConfig{};
  throw UsageError("unknown Llama size '" + name + "'; use llama-tiny, or a Hugging Face folder");
}

int64_t llama_flops_per_token(const LlamaConfig& c) {
  const int64_t w = c.hidden_size, d = c.dim();
  const int64_t attn = w * c.n_heads * d * 2 + w * c.n_kv_heads * d * 2;
  const int64_t block = attn + 3 * w * c.intermediate_size + 2 * w;
  int64_t n = c.n_layers * block + w + c.vocab_size * w;
  for (int64_t i = 0; i < c.n_layers; ++i) {  // a MoE layer: its router and k experts
    if (c.moe.at(i))
      n += c.moe.active_parameters(w, 3 * w * c.intermediate_size) - 3 * w * c.intermediate_size;
  }
  return 6 * n + 12 * c.n_layers * c.n_heads * d * c.max_positions;
}

LlamaImpl::LlamaImpl(const LlamaConfig& c)
    : config_(c), cp_(std::make_shared<ContextParallelism>()) {
  check_shape(c);
  model_ = register_module("model", std::make_shared<torch::nn::Module>());
  embed_tokens_ =
      model_->register_module("embed_tokens", ParallelEmbedding(c.vocab_size, c.hidden_size));
  layers_ = model_->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) layers_->push_back(LlamaLayer(c, cp_, i));
  norm_ = model_->register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps).ptr());
  if (!c.tied_head) {
    lm_head_ = register_module(
        "lm_head", ParallelLinear(ParallelLinearOptions(c.hidden_size, c.vocab_size).bias(false)));
  }
  torch::NoGradGuard no_grad;  // transformers' initialisation: N(0, 0.02), the norms ones
  for (const auto& p : named_parameters()) {
    if (p.key().find("norm") == std::string::npos) torch::nn::init::normal_(p.value(), 0.0, 0.02);
  }
}

at::Tensor LlamaImpl::forward(const at::Tensor& ids) {
  auto x = embed(ids);
  for (const auto& layer : *layers_) {
    auto* l = layer->as<LlamaLayer>();
    x = config_.checkpoint_blocks && is_training()
            ? activation_checkpoint([l](const at::Tensor& in) { return l->forward(in); }, x)
            : l->forward(x);
  }
  return head(x);
}

at::Tensor LlamaImpl::embed(const at::Tensor& ids) {
  if (ids.dim() != 2 || ids.size(1) > config_.max_positions) {
    throw UsageError("Llama: token ids " + c10::str(ids.sizes()) +
                     ": it takes [batch, positions] of at most " +
                     std::to_string(config_.max_positions) + " positions (its context)");
  }
  return embed_tokens_(ids);  // [B, T, C], or this rank's slice of the positions
}

at::Tensor LlamaImpl::head(const at::Tensor& in) {
  auto x = norm_->as<RMSNorm>()->forward(in);
  if (lm_head_) return lm_head_(x);
  if (tp_) x = sequence_parallel_ ? gather_from_sequence(x, *tp_, 1) : copy_to_region(x, *tp_);
  return at::linear(x, embed_tokens_->weight);
}

at::Tensor LlamaImpl::loss(const at::Tensor& logits, const at::Tensor& targets) const {
  if (tp_) return vocab_parallel_cross_entropy(logits, targets, *tp_);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

TensorParallelPlan LlamaImpl::plan(bool sp) const {
  TensorParallelPlan p;
  p["model.embed_tokens"] = vocab_parallel(sp);
  if (!config_.tied_head) p["lm_head"] = colwise(1, sp);
  for (int64_t i = 0; i < config_.n_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    for (const char* name : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}) {
      p[l + name] = colwise(1, sp);
    }
    p[l + "self_attn.o_proj"] = rowwise(sp);
    if (config_.moe.at(i)) continue;  // a MoE layer: its experts whole on every tp rank
    p[l + "mlp.gate_proj"] = colwise(1, sp);
    p[l + "mlp.up_proj"] = colwise(1, sp);
    p[l + "mlp.down_proj"] = rowwise(sp);
  }
  return p;
}

void LlamaImpl::parallelize(const Dist& tp, bool sp) {
  const int64_t t = tp.size();
  const auto refuse = [&](const std::string& what, int64_t n) {
    throw UsageError("tensor parallelism: Llama's " + std::to_string(n) + " " + what +
                     " do not split over " + std::to_string(t) +
                     " ranks; use a degree that divides them");
  };
  if (config_.n_heads % t != 0) refuse("heads", config_.n_heads);
  if (config_.n_kv_heads % t != 0) refuse("key/value heads (n_kv_heads)", config_.n_kv_heads);
  if (config_.intermediate_size % t != 0) refuse("MLP columns", config_.intermediate_size);
  if (config_.vocab_size % t != 0) refuse("vocabulary rows", config_.vocab_size);
  parallelize_module(*this, tp, plan(sp));
  tp_ = std::make_shared<const Dist>(tp);
  sequence_parallel_ = sp;
}

void LlamaImpl::context_parallel(const Dist* cp, const ContextSplit& split) { cp_->set(cp, split); }

torch::nn::Sequential LlamaImpl::blocks() {
  if (config_.tied_head) {
    throw UsageError(
        "Llama: a tied head shares embed_tokens' weight between the first and the last block, "
        "which pipeline stages and fsdp units cannot share; untie it for them");
  }
  torch::nn::Sequential seq;
  auto self = std::static_pointer_cast<LlamaImpl>(shared_from_this());
  seq->push_back("embed", Block(BlockParts{{"embed_tokens", embed_tokens_.ptr()}},
                                [self](const at::Tensor& ids) { return self->embed(ids); }));
  for (size_t i = 0; i < layers_->size(); ++i) {
    auto l = layers_[i];
    seq->push_back("layer" + std::to_string(i),
                   Block(BlockParts{{"layer", l}},
                         [l](const at::Tensor& x) { return l->as<LlamaLayer>()->forward(x); }));
  }
  seq->push_back("head", Block(BlockParts{{"norm", norm_}, {"lm_head", lm_head_.ptr()}},
                               [self](const at::Tensor& x) { return self->head(x); }));
  return seq;
}

}  // namespace scaletrain
