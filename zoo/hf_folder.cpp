#include "hf_folder.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

int64_t whole_field(const nlohmann::json& j, const std::string& key, const std::string& file,
                    std::optional<int64_t> fallback = std::nullopt) {
  if (!j.contains(key) || j.at(key).is_null()) {
    if (fallback) return *fallback;
    throw UsageError(file + ": no \"" + key + "\" (a Llama's config names it)");
  }
  if (!j.at(key).is_number_integer() || j.at(key).get<int64_t>() <= 0) {
    throw UsageError(file + ": \"" + key + "\" is " + j.at(key).dump() +
                     ", not a positive whole number");
  }
  return j.at(key).get<int64_t>();
}

double real_field(const nlohmann::json& j, const std::string& key, const std::string& file,
                  double fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  if (!j.at(key).is_number() || j.at(key).get<double>() <= 0) {
    throw UsageError(file + ": \"" + key + "\" is " + j.at(key).dump() + ", not a positive number");
  }
  return j.at(key).get<double>();
}

}  // namespace

bool is_hf_folder(const std::string& path) {
  return fs::is_directory(path) && fs::is_regular_file(fs::path(path) / "config.json");
}

namespace {
nlohmann::json read_config(const std::string& file) {
  try {
    return nlohmann::json::parse(std::ifstream(file));
  } catch (const std::exception& e) {
    throw UsageError(file + " is not JSON: " + e.what());
  }
}
}  // namespace

std::string hf_model_type(const std::string& dir) {
  const auto j = read_config((fs::path(dir) / "config.json").string());
  return j.contains("model_type") && j.at("model_type").is_string()
             ? j.at("model_type").get<std::string>()
             : "(none)";
}

GPTConfig gpt_config_from_hf(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  const nlohmann::json j = read_config(file);
  const std::string act = j.value("activation_function", std::string("gelu_new"));
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu") {
    throw UsageError(file + ": \"activation_function\" \"" + act +
                     "\"; the zoo's GPT takes gelu_new (GPT-2's) or gelu");
  }
  if (j.value("n_inner", nlohmann::json()).is_number()) {
    throw UsageError(file + ": \"n_inner\" is not supported (the MLP is 4 times the width)");
  }
  if (j.value("scale_attn_by_inverse_layer_idx", false) ||
      j.value("reorder_and_upcast_attn", false)) {
    throw UsageError(file +
                     ": scale_attn_by_inverse_layer_idx and reorder_and_upcast_attn are "
                     "not supported");
  }
  GPTConfig c;
  c.vocab_size = whole_field(j, "vocab_size", file);
  c.block_size = whole_field(j, "n_positions", file);
  c.n_layer = whole_field(j, "n_layer", file);
  c.n_head = whole_field(j, "n_head", file);
  c.n_embd = whole_field(j, "n_embd", file);
  c.tied_head = j.value("tie_word_embeddings", true);
  c.gelu_tanh = act != "gelu";
  return c;
}

std::string hf_config_json(const GPTConfig& c) {
  nlohmann::json j = {{"architectures", {"GPT2LMHeadModel"}},
                      {"model_type", "gpt2"},
                      {"vocab_size", c.vocab_size},
                      {"n_positions", c.block_size},
                      {"n_embd", c.n_embd},
                      {"n_layer", c.n_layer},
                      {"n_head", c.n_head},
                      {"activation_function", c.gelu_tanh ? "gelu_new" : "gelu"},
                      {"layer_norm_epsilon", 1e-5},
                      {"tie_word_embeddings", c.tied_head},
                      {"torch_dtype", "float32"}};
  return j.dump(2) + "\n";
}

namespace {
bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() > tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// GPT2LMHeadModel's Conv1D layers: weight [in, out], the transpose of a Linear's.
bool conv1d(const std::string& name) {
  for (const char* tail :
       {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    if (ends_with(name, tail)) return true;
  }
  return false;
}
}  // namespace

std::map<std::string, at::Tensor> gpt_from_hf(std::map<std::string, at::Tensor> tensors) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : tensors) {
    if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias")) {
      continue;  // older files' buffers
    }
    const std::string key = name.rfind("transformer.", 0) == 0 || name == "lm_head.weight"
                                ? name
                                : "transformer." + name;  // GPT2Model's files: no prefix
    out[key] = conv1d(key) ? t.t().contiguous() : t;
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> gpt_to_hf(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : module.named_parameters()) {
    const at::Tensor t = p.value().detach();
    out.emplace_back(p.key(), conv1d(p.key()) ? t.t().contiguous() : t);
  }
  return out;
}

LlamaConfig llama_config_from_hf(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  const nlohmann::json j = read_config(file);
  const std::string type = j.value("model_type", std::string("(none)"));
  if (type != "llama") {
    throw UsageError(file + ": model_type \"" + type +
                     "\"; scaletrain builds \"llama\" (Llama 2 and 3, and the models of their "
                     "shape) and \"gpt2\" from a Hugging Face folder");
  }
  if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
    throw UsageError(file + ": \"rope_scaling\" " + j.at("rope_scaling").dump() +
                     " is not supported yet (plain rotary embeddings only); remove it to train "
                     "at the model's original context");
  }
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    if (j.value(bias, false)) throw UsageError(file + ": \"" + bias + "\" true is not supported");
  }
  if (j.value("hidden_act", std::string("silu")) != "silu") {
    throw UsageError(file + ": \"hidden_act\" " + j.at("hidden_act").dump() +
                     "; a Llama's MLP is SwiGLU (\"silu\")");
  }
  LlamaConfig c;
  c.vocab_size = whole_field(j, "vocab_size", file);
  c.hidden_size = whole_field(j, "hidden_size", file);
  c.intermediate_size = whole_field(j, "intermediate_size", file);
  c.n_layers = whole_field(j, "num_hidden_layers", file);
  c.n_heads = whole_field(j, "num_attention_heads", file);
  c.n_kv_heads = whole_field(j, "num_key_value_heads", file, c.n_heads);
  c.head_dim = whole_field(j, "head_dim", file, c.hidden_size / c.n_heads);
  c.max_positions = whole_field(j, "max_position_embeddings", file);
  c.rope_theta = real_field(j, "rope_theta", file, 10000.0);
  c.rms_norm_eps = real_field(j, "rms_norm_eps", file, 1e-6);
  c.tied_head = j.value("tie_word_embeddings", false);
  return c;
}

std::string hf_config_json(const LlamaConfig& c) {
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.n_layers},
                      {"num_attention_heads", c.n_heads},
                      {"num_key_value_heads", c.n_kv_heads},
                      {"head_dim", c.dim()},
                      {"max_position_embeddings", c.max_positions},
                      {"rope_theta", c.rope_theta},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"tie_word_embeddings", c.tied_head},
                      {"hidden_act", "silu"},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"torch_dtype", "float32"}};
  return j.dump(2) + "\n";
}

// Note [Hugging Face folder written whole]: the folder is made beside its place (DIR.tmp) and
// renamed into it, so a reader finds a whole folder or none, never shards of two runs.
void write_hf_folder(const std::string& dir, const std::string& config_json,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     int64_t shard_bytes) {
  const fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t n = static_cast<int64_t>(t.nbytes());
    if (in_shard > 0 && in_shard + n > shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(name, t);
    in_shard += n;
    total += n;
  }
  std::ofstream(tmp / "config.json") << config_json;
  if (shards.size() == 1) {
    save_safetensors((tmp / "model.safetensors").string(), shards[0]);
  } else {
    nlohmann::json map = nlohmann::json::object();
    const auto name = [&](size_t k) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      return std::string(buf);
    };
    for (size_t k = 0; k < shards.size(); ++k) {
      save_safetensors((tmp / name(k)).string(), shards[k]);
      for (const auto& [key, t] : shards[k]) map[key] = name(k);
    }
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    std::ofstream(tmp / "model.safetensors.index.json") << index.dump(2) << "\n";
  }
  fs::remove_all(dir);
  fs::rename(tmp, dir);
}

}  // namespace scaletrain
