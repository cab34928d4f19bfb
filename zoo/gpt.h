#pragma once
// The zoo's GPT (internal): a decoder-only transformer with nanoGPT's layout and parameter names
// (transformer.wte, transformer.wpe, transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2,
// mlp.c_fc, mlp.c_proj}, transformer.ln_f; the LM head tied to wte): token and position
// embeddings, pre-LayerNorm blocks of causal self-attention (scaled_dot_product_attention) and a
// GELU MLP of four times the width, a final LayerNorm and the logits over the vocabulary. Built
// from ParallelLinear and ParallelEmbedding, so that parallelize() splits it over a
// tensor-parallel group with Megatron's plan (tensor_parallel.h).

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <string>

#include "moe_config.h"
#include "scaletrain/tensor_parallel.h"

namespace scaletrain {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t block_size = 64;  // the longest context
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 64;
  double dropout = 0;              // attention and residual dropout
  bool tied_head = true;           // the LM head is wte's weight (GPT-2); false: lm_head of its own
  bool gelu_tanh = false;          // the MLP's GELU in its tanh form (GPT-2's "gelu_new")
  bool checkpoint_blocks = false;  // training: each block recomputed in backward
                                   // (activation_checkpoint.h), its activations not kept
  ZooMoE moe;  // experts > 0: MoE layers (h.<i>.moe.{router, w1, w2}) in place of the MLPs
               // it names, each expert a GELU MLP of four times the width
};

/// "gpt-tiny" (2 layers, 4 heads, 64 wide, context 64, bytes: vocabulary 256) and "gpt2-small"
/// (GPT-2's 124M: 12 layers, 12 heads, 768 wide, context 1024, vocabulary 50257). Throws
/// UsageError naming them for another name.
GPTConfig gpt_config(const std::string& name);

/// Note [GPT FLOPs]: the parameters that the model-FLOPs estimate counts as N: every weight and
/// bias that a token meets in a matrix product or an elementwise op (the blocks, ln_f) plus the
/// LM head's vocabulary × width, and not the lookups: the position embeddings (wpe), and wte when
/// the head is untied (a tied wte is counted once, as the head). The same N for a tied and an
/// untied head, since both compute the same; for a tied head it is nanoGPT's
/// get_num_params() (all parameters but wpe): 123,653,376 for gpt2-small.
int64_t gpt_flops_parameters(const GPTConfig& config);

/// Training FLOPs (forward and backward) per token at the full context, PaLM's appendix B
/// (nanoGPT's estimate_mfu): 6·N for the products with the weights (2 forward, 4 backward per
/// parameter; N = gpt_flops_parameters) plus 12·L·H·Q·T for attention's two products with the
/// sequence (L layers, H heads, Q = n_embd / H, T = block_size; causal masking's saved half not
/// subtracted, as in both). Model FLOPs: activation checkpointing's recomputation is not
/// counted. One sample of T tokens is T times this.
int64_t gpt_flops_per_token(const GPTConfig& config);

struct LayerContext;  // gpt.cpp
struct ContextSplit;

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& config);
  /// Token ids [batch, T] (T ≤ block_size) to logits [batch, T, vocab] — under a tensor-parallel
  /// plan, this rank's slice of the vocabulary (loss() takes them as they are).
  at::Tensor forward(const at::Tensor& ids);
  /// Mean cross entropy of `logits` (forward's) against `targets` [batch, T], `ignore_index`
  /// left out: the vocabulary-parallel one under a plan.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets,
                  int64_t ignore_index = -100) const;
  /// Megatron's plan for this model: c_attn colwise in three chunks (q, k, v: each rank its
  /// heads), attn.c_proj rowwise, mlp.c_fc colwise, mlp.c_proj rowwise, wte by vocabulary; with
  /// `sequence_parallel` the LayerNorms, residuals and position embeddings hold a slice of the
  /// sequence.
  TensorParallelPlan plan(bool sequence_parallel) const;
  /// Applies plan() over `tp` (with sequence parallelism the plan sums the replicated parameters'
  /// gradients over the group in backward: nothing to call after it). Throws UsageError when the
  /// heads, width or vocabulary do not divide by tp.size(). With dropout, every rank of `tp` must
  /// draw from a generator in the same state (coordinated_dropout.h): the masks are then the
  /// unsplit model's.
  void parallelize(const Dist& tp, bool sequence_parallel);
  /// Context parallelism (Model::context_parallel): forward takes this rank's slice of each
  /// sequence, its positions and ring attention over `cp`; null turns it off. UsageError with
  /// dropout.
  void context_parallel(const Dist* cp, const ContextSplit& split);
  /// The generator the dropout masks are drawn from (by default the device's own), e.g. one per
  /// rank where ranks are threads of one process, which share the default one. Not replayed by
  /// checkpoint_blocks' recomputation (activation_checkpoint.h replays the default generators):
  /// leave it unset with checkpoint_blocks.
  void set_dropout_generator(at::Generator generator);
  /// The model as a chain of blocks sharing its parameters (blocks.h): "embed" (wte, wpe), "h<i>"
  /// per transformer block, "head" (ln_f, lm_head), for the pipeline and fsdp strategies. Throws
  /// UsageError for a tied head (one weight in two blocks, which stages on two devices cannot
  /// share): build it with tied_head = false.
  torch::nn::Sequential blocks();
  const GPTConfig& config() const { return config_; }

 private:
  at::Tensor embed(const at::Tensor& ids);
  at::Tensor head(at::Tensor x);

  GPTConfig config_;
  std::shared_ptr<torch::nn::Module> transformer_;
  ParallelEmbedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList h_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  ParallelLinear lm_head_{nullptr};  // untied only
  std::shared_ptr<const Dist> tp_;
  bool sequence_parallel_ = false;
  std::shared_ptr<LayerContext> shared_;  // shared with the blocks
};
TORCH_MODULE(GPT);

}  // namespace scaletrain
