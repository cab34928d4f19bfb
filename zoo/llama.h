#pragma once
// The zoo's Llama (internal): the decoder of Meta's Llama family with Hugging Face's layout and
// parameter names (model.embed_tokens, model.layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head), so that a Hugging
// Face folder's tensors load by name (hf_folder.h): RMSNorm, rotary position embeddings (Hugging
// Face's rotate-half layout and rope_theta), grouped-query attention (n_kv_heads key/value heads,
// scaled_dot_product_attention with enable_gqa), a SwiGLU MLP, a tied or untied head. Built from
// ParallelLinear and ParallelEmbedding: parallelize() splits q/k/v/gate/up by columns and o/down
// by rows, the vocabulary of the embedding and the head, with sequence parallelism over the
// RMSNorms (tensor_parallel.h).

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <string>

#include "moe_config.h"
#include "scaletrain/tensor_parallel.h"

namespace scaletrain {

struct ContextParallelism;  // context_parallel.h
struct ContextSplit;

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 176;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t head_dim = 0;        // 0: hidden_size / n_heads
  int64_t max_positions = 64;  // the longest context
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tied_head = false;          // the head is embed_tokens' weight
  bool checkpoint_blocks = false;  // training: each block recomputed in backward
  ZooMoE moe;  // experts > 0: MoE layers (layers.<i>.moe.{router, w1, w3, w2}) in place of the
               // MLPs it names, each expert a SwiGLU MLP intermediate_size wide

  int64_t dim() const { return head_dim > 0 ? head_dim : hidden_size / n_heads; }
};

/// "llama-tiny": 2 layers, 4 heads over 2 key/value heads, 64 wide, context 64, bytes
/// (vocabulary 256). UsageError naming it for another name.
LlamaConfig llama_config(const std::string& name);

/// Training FLOPs per token at the full context (as gpt_flops_per_token: 6·N for the weights'
/// products, the embedding's lookup not counted, plus 12·L·H·Q·T for attention).
int64_t llama_flops_per_token(const LlamaConfig& config);

/// The rotary embeddings' cos and sin [t, d] of positions 0 … t − 1 for heads of width d, in
/// fp32 (Note [Llama as Hugging Face computes it] in llama.cpp).
std::pair<at::Tensor, at::Tensor> llama_rotary(int64_t t, int64_t d, double theta,
                                               const at::TensorOptions& options = {});
/// The same at the given positions (an int64 tensor of t; the result on its device): the
/// rotations of a slice of the sequence, as context parallelism holds one.
std::pair<at::Tensor, at::Tensor> llama_rotary_at(const at::Tensor& positions, int64_t d,
                                                  double theta);

class LlamaImpl : public torch::nn::Module {
 public:
  /// UsageError for a config whose widths do not split into its heads.
  explicit LlamaImpl(const LlamaConfig& config);
  /// Token ids [batch, T] (T ≤ max_positions) to logits [batch, T, vocab] (under a plan, this
  /// rank's slice of the vocabulary).
  at::Tensor forward(const at::Tensor& ids);
  /// Mean cross entropy of forward's logits against `targets`; the vocabulary-parallel one under
  /// a plan.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;
  TensorParallelPlan plan(bool sequence_parallel) const;
  /// Applies plan() over `tp`. UsageError when tp.size() does not divide the heads, the
  /// key/value heads, the MLP's width or the vocabulary.
  void parallelize(const Dist& tp, bool sequence_parallel);
  /// Context parallelism (Model::context_parallel): forward takes this rank's slice of each
  /// sequence, rotary embeddings at its positions and ring attention over `cp`; null: off.
  void context_parallel(const Dist* cp, const ContextSplit& split);
  /// "embed", "layer<i>" per decoder layer, "head" (norm, lm_head): pipelines and fsdp's units.
  /// UsageError for a tied head.
  torch::nn::Sequential blocks();
  const LlamaConfig& config() const { return config_; }

 private:
  at::Tensor embed(const at::Tensor& ids);
  at::Tensor head(const at::Tensor& x);

  LlamaConfig config_;
  std::shared_ptr<torch::nn::Module> model_;
  ParallelEmbedding embed_tokens_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  std::shared_ptr<torch::nn::Module> norm_;
  ParallelLinear lm_head_{nullptr};  // untied only
  std::shared_ptr<const Dist> tp_;
  bool sequence_parallel_ = false;
  std::shared_ptr<ContextParallelism> cp_;  // shared with the attention layers
};
TORCH_MODULE(Llama);

}  // namespace scaletrain
