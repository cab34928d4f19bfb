#pragma once
// The model zoo of the seed tutorials, as LibTorch modules with PyTorch's parameter names.
//
//   ToyModel  10 -> 10 -> ReLU -> 5 (net1, net2), seed 000
//   MLP       in -> hidden -> ReLU -> dropout (p = ModelOptions::dropout, 0 by default) ->
//             classes (fc1, fc2)
//   LeNet     seed 004's: conv 1->20 3x3, ReLU, avg-pool 2, conv 20->50 5x5, ReLU, avg-pool 2,
//             fc 800->128, ReLU, fc 128->10 (conv1, conv2, fc1, fc2); 28x28 inputs
//   resnet18  seed 003's small-image ResNet-18: 3x3 stride-1 stem, no max-pool, BasicBlocks
//             [2,2,2,2], global average pool, fc; torchvision's parameter names
//   gpt-tiny, gpt2-small  a decoder-only transformer with nanoGPT's layout and names (2 layers,
//             4 heads, 64 wide, context 64, bytes; GPT-2's 124M: 12 layers, 12 heads, 768 wide,
//             context 1024, vocabulary 50257), an untied LM head (lm_head) so that every
//             strategy can split it; token ids [batch, positions] to logits [batch, positions,
//             vocabulary]; blocks embed, h0 ..., head
//   llama-tiny  the Llama family's decoder with Hugging Face's names (llama.h: RMSNorm, rotary
//             embeddings, grouped-query attention, SwiGLU; 2 layers, 4 heads over 2 key/value
//             heads, 64 wide, context 64, bytes); a Hugging Face folder (config.json of
//             model_type llama and its safetensors, hf_folder.h) builds and loads the same
//   resnet50, resnet101  torchvision's (Bottleneck [3,4,6,3] / [3,4,23,3], ImageNet stem);
//             use in_channels 3 and num_classes 1000 for torchvision's exact model
//
// make_model() builds one by name as the library's Model (scaletrain/model.h); as_sequential()
// gives each as a chain of blocks sharing its parameters: toy "net1", "net2"; mlp "fc1",
// "fc2"; lenet "conv1", "conv2", "fc1", "fc2"; ResNets "stem", "layer1_0" ...
// "layer4_<last>", "head"; GPTs "embed", "h0" ..., "head". Not part of the installed
// library: the command line, the benchmarks and the tests use it.

#include <string>
#include <vector>

#include "scaletrain/model.h"

namespace scaletrain {

struct ModelOptions {
  int64_t num_classes = 10;
  int64_t in_channels = 1;              // image models
  int64_t in_features = 784;            // MLP
  int64_t hidden = 256;                 // MLP
  double dropout = 0;                   // MLP, GPT: the probability of its dropout
  int64_t vocab_size = 0;               // GPT: the vocabulary (0: the size's own)
  int64_t context = 0;                  // GPT: the longest sequence (0: the size's own)
  int64_t experts = 0;                  // GPTs, Llamas: MoE layers of this many experts
  int64_t top_k = 2;                    //   each token's experts
  int64_t moe_every = 1;                //   the MLP of every n-th layer a MoE
  double aux_loss_coef = 0.01;          //   the load-balancing loss's coefficient
  bool checkpoint_activations = false;  // GPT: each block recomputed in backward, its
                                        // activations not kept (activation_checkpoint.h)
  /// The zoo's model-level CPU optimisations: LeNet's crop of the input to what its pools read
  /// (Note [Unread border]), its fused relu + 2x2 average pool, and the stem convolutions'
  /// weight gradient as one batched product (Note [Stem conv]); each is the plain model's
  /// function. false: LibTorch's own ops only, layer for layer what the Python model writes
  /// (conv, relu, avg_pool2d), as the framework comparison needs.
  bool model_optimizations = true;
};

/// "toy", "mlp", "lenet", "resnet18", "resnet50", "resnet101", "gpt-tiny", "gpt2-small". Throws
/// UsageError naming the known models for any other name.
/// A name that is a path (it ends in .pt or .pth, or names a file) loads that Python model
/// (load_python_model, python_model.h); `options` do not apply to it.
Model make_model(const std::string& name, const ModelOptions& options = {});
/// Whether make_model() takes `name` as a Python model's file.
bool is_python_model_name(const std::string& name);

/// A Llama's config: "llama-tiny"'s or a Hugging Face folder's (hf_folder.h), with the options'
/// vocabulary, context (not a folder's: its config keeps its positions) and activation
/// checkpointing where given.
struct LlamaConfig;
LlamaConfig llama_config_of(const std::string& name, const ModelOptions& options = {});
/// Whether make_model() builds `name` as a Llama: "llama-tiny", or a Hugging Face folder whose
/// model_type is not "gpt2" (the Llama's config refuses any but "llama", by name).
bool is_llama_name(const std::string& name);

/// The zoo's GPT and Llama of a config as the library's Model (fresh weights): its forward, its
/// blocks (an untied head only), its tensor-parallel split and parallel loss, its FLOPs.
struct GPTConfig;
Model gpt_model(const std::string& name, const GPTConfig& config);
Model llama_model(const std::string& name, const LlamaConfig& config);

/// The names make_model() knows.
std::vector<std::string> model_names();

}  // namespace scaletrain
