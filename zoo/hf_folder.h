#pragma once
// Hugging Face model folders (internal to the zoo): `config.json` and the weights in safetensors
// (`model.safetensors`, or shards `model-0000N-of-0000M.safetensors` listed by
// `model.safetensors.index.json`), the layout transformers' save_pretrained writes and
// from_pretrained reads. The zoo builds its Llama (model_type "llama": its parameters carry
// Hugging Face's names, llama.h) or its GPT (model_type "gpt2": GPT2LMHeadModel's names, its
// Conv1D weights stored transposed) from the config and loads the tensors; at the end of a run
// it writes the trained weights back in the same layout (docs/llama.md).

#include <string>

#include "gpt.h"
#include "llama.h"

namespace scaletrain {

/// Whether `path` is a folder with a config.json.
bool is_hf_folder(const std::string& path);

/// DIR/config.json's model_type ("llama", "gpt2", ...; "(none)" without one).
std::string hf_model_type(const std::string& dir);

/// The GPT-2 that DIR/config.json describes (model_type "gpt2"): GELU in its tanh form, the head
/// tied unless tie_word_embeddings is false. UsageError naming the field as for a Llama.
GPTConfig gpt_config_from_hf(const std::string& dir);
std::string hf_config_json(const GPTConfig& config);

/// GPT2LMHeadModel's tensors as the zoo GPT's (Conv1D weights transposed, the attention's mask
/// buffers of older files dropped), and back (`module` a zoo GPT).
std::map<std::string, at::Tensor> gpt_from_hf(std::map<std::string, at::Tensor> tensors);
std::vector<std::pair<std::string, at::Tensor>> gpt_to_hf(const torch::nn::Module& module);

/// The Llama that DIR/config.json describes. UsageError naming the field for a model_type other
/// than "llama", a missing or non-numeric field, or rope scaling of a kind not supported.
LlamaConfig llama_config_from_hf(const std::string& dir);

/// The config.json that describes `config` (model_type llama, fp32 weights).
std::string hf_config_json(const LlamaConfig& config);

/// DIR/config.json (`config_json`) and `tensors` as safetensors: one model.safetensors, or
/// shards of at most `shard_bytes` each with their model.safetensors.index.json. The folder is
/// written beside and renamed into place: a reader finds a whole folder or none.
void write_hf_folder(const std::string& dir, const std::string& config_json,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     int64_t shard_bytes = int64_t{5} << 30);

}  // namespace scaletrain
