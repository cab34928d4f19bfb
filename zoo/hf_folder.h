#pragma once
// Hugging Face model folders (internal to the zoo): `config.json` and the weights in safetensors
// (`model.safetensors`, or shards `model-0000N-of-0000M.safetensors` listed by
// `model.safetensors.index.json`), the layout transformers' save_pretrained writes and
// from_pretrained reads. The zoo builds its Llama from the config (model_type "llama") and loads
// the tensors by name (its parameters carry Hugging Face's names, llama.h); at the end of a run
// it writes the trained weights back in the same layout (docs/llama.md).

#include <string>

#include "llama.h"

namespace scaletrain {

/// Whether `path` is a folder with a config.json.
bool is_hf_folder(const std::string& path);

/// The Llama that DIR/config.json describes. UsageError naming the field for a model_type other
/// than "llama", a missing or non-numeric field, or rope scaling of a kind not supported.
LlamaConfig llama_config_from_hf(const std::string& dir);

/// The config.json that describes `config` (model_type llama, fp32 weights).
std::string hf_config_json(const LlamaConfig& config);

/// DIR/config.json (`config`'s) and the module's weights as safetensors: one model.safetensors,
/// or shards of at most `shard_bytes` each with their model.safetensors.index.json. The folder
/// is written beside and renamed into place, so a crash leaves the old one or the new one.
void write_hf_folder(const std::string& dir, const LlamaConfig& config,
                     const torch::nn::Module& module, int64_t shard_bytes = int64_t{5} << 30);

}  // namespace scaletrain
