// State dicts shared with Python, in two formats (and, to load, a third: a folder of
// torch.distributed.checkpoint, distributed_checkpoint.h):
//  - torch.save's zip archive, read by torch.load (also with weights_only=True, its default):
//    written with LibTorch's pickler with type tags off, so the pickle holds a plain dict of
//    tensors and nothing but allowed globals; read with torch::pickle_load;
//  - safetensors (a little-endian u64 header length, a JSON header naming each tensor's dtype,
//    shape and byte range, then the bytes), written and read here.

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>

#include "runtime/atomic_file.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {

namespace {

// Parameters and buffers by their dotted names, as Module::state_dict() in Python lists them.
std::vector<std::pair<std::string, at::Tensor>> state_of(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

std::string list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 5; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 5) s += " and " + std::to_string(names.size() - 5) + " more";
  return s;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

const std::vector<std::pair<std::string, at::ScalarType>>& safetensors_dtypes() {
  static const std::vector<std::pair<std::string, at::ScalarType>> t = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return t;
}

// torch.save's format, with a plain (untagged) dict so that weights_only loading accepts it.
std::vector<char> torch_save_bytes(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : state) dict.insert(name, t);
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* b, size_t n) { pickle.insert(pickle.end(), b, b + n); }, nullptr, nullptr,
      nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* b, size_t n) {
    out.insert(out.end(), static_cast<const char*>(b), static_cast<const char*>(b) + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return out;
}

std::vector<char> safetensors_bytes(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  size_t offset = 0;
  for (const auto& [name, t] : state) {
    std::string dtype;
    for (const auto& [n, st] : safetensors_dtypes()) {
      if (st == t.scalar_type()) dtype = n;
    }
    if (dtype.empty()) {
      throw Error("cannot save '" + name + "' as safetensors: unsupported dtype " +
                  c10::toString(t.scalar_type()));
    }
    const size_t n = t.nbytes();
    header[name] = {
        {"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  const uint64_t len = h.size();
  std::string buf(sizeof len, '\0');
  std::memcpy(buf.data(), &len, sizeof len);
  buf += h;
  for (const auto& kv : state) {
    const at::Tensor c = kv.second.contiguous();
    buf.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  return {buf.begin(), buf.end()};
}

std::map<std::string, at::Tensor> read_safetensors(const std::string& path,
                                                   const std::vector<char>& bytes) {
  auto bad = [&](const std::string& why) {
    return Error("'" + path + "' is neither a torch.save archive nor a valid safetensors file (" +
                 why + ")");
  };
  if (bytes.size() < 8) throw bad("too short");
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  if (len > bytes.size() - 8) throw bad("header length past the end");
  nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(len), nullptr,
                            /*allow_exceptions=*/false);
  if (!header.is_object()) throw bad("header is not a JSON object");
  const char* data = bytes.data() + 8 + len;
  const size_t data_size = bytes.size() - 8 - len;
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    at::ScalarType st = at::kFloat;
    bool known = false;
    for (const auto& [n, t] : safetensors_dtypes()) {
      if (info.value("dtype", "") == n) st = t, known = true;
    }
    if (!known)
      throw bad("tensor '" + name + "' has unsupported dtype " + info.value("dtype", "?"));
    const auto shape = info.at("shape").get<std::vector<int64_t>>();
    const auto range = info.at("data_offsets").get<std::vector<size_t>>();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st));
    if (range.size() != 2 || range[1] > data_size || range[1] - range[0] != t.nbytes())
      throw bad("tensor '" + name + "' has a byte range that does not fit its shape");
    std::memcpy(t.data_ptr(), data + range[0], t.nbytes());
    out[name] = t;
  }
  return out;
}

}  // namespace

void save_weights(const std::string& path, const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [name, t] : state_of(model))
    state.emplace_back(name, t.detach().cpu().contiguous());
  const std::vector<char> bytes =
      ends_with(path, ".safetensors") ? safetensors_bytes(state) : torch_save_bytes(state);
  write_atomically(path, std::string_view(bytes.data(), bytes.size()), "model weights");
}

namespace {

// A folder of torch.distributed.checkpoint: dcp.save({"model": model.state_dict()}) keeps the
// parameters under "model.", dcp.save(model.state_dict()) at the top. The layout that names more
// of the model's keys is the folder's; under "model." the rest of the folder (an optimizer's
// "optim.*", the program's own keys) is not the weights' business.
std::map<std::string, at::Tensor> read_dcp_weights(const std::string& dir,
                                                   const torch::nn::Module& model) {
  const DcpContents contents = read_distributed_checkpoint_contents(dir);
  size_t nested = 0, plain = 0;
  for (const auto& [name, t] : state_of(model)) {
    nested += contents.tensors.count("model." + name);
    plain += contents.tensors.count(name);
  }
  return load_distributed_checkpoint_tensors(dir, nested > plain ? "model." : "");
}

std::map<std::string, at::Tensor> read_weights_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("cannot read model weights '" + path + "': no such file or unreadable");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 2 || bytes[0] != 'P' || bytes[1] != 'K') return read_safetensors(path, bytes);
  c10::IValue v;  // a zip: torch.save's format
  try {
    v = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    // LibTorch's unpickler cannot rebuild an OrderedDict, the type of model.state_dict().
    throw Error("cannot read the state dict in '" + path + "' (" +
                std::string(e.what()).substr(0, 120) +
                "...); in Python save it as a plain dict, torch.save(dict(model.state_dict()), "
                "path), or as safetensors, safetensors.torch.save_file(model.state_dict(), "
                "path)");
  }
  if (!v.isGenericDict()) {
    throw Error("'" + path + "' holds a " + v.tagKind() +
                ", not a state dict; save dict(model.state_dict()) in Python");
  }
  std::map<std::string, at::Tensor> loaded;
  for (const auto& kv : v.toGenericDict()) {
    if (kv.key().isString() && kv.value().isTensor())
      loaded[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return loaded;
}

// A Hugging Face folder's weights: model.safetensors, or every shard its index lists; nullopt
// for a folder of neither.
std::optional<std::map<std::string, at::Tensor>> read_hf_weights(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(index)) {
    const fs::path one = fs::path(dir) / "model.safetensors";
    if (!fs::exists(one)) return std::nullopt;
    return read_weights_file(one.string());
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::ifstream(index)).at("weight_map");
  } catch (const std::exception& e) {
    throw Error("'" + index.string() + "' is not a safetensors index (a JSON object whose " +
                "weight_map maps each tensor to its shard): " + e.what());
  }
  std::set<std::string> shards;
  for (const auto& [name, file] : j.items()) shards.insert(file.get<std::string>());
  std::map<std::string, at::Tensor> out;
  for (const auto& file : shards) out.merge(read_weights_file((fs::path(dir) / file).string()));
  return out;
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [name, t] : tensors) state.emplace_back(name, t.detach().cpu().contiguous());
  const std::vector<char> bytes = safetensors_bytes(state);
  write_atomically(path, std::string_view(bytes.data(), bytes.size()), "safetensors");
}

std::map<std::string, at::Tensor> read_weights(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return read_weights_file(path);
  if (auto hf = read_hf_weights(path)) return std::move(*hf);
  throw Error("'" + path + "' holds no model.safetensors nor model.safetensors.index.json");
}

void load_weights(const std::string& path, torch::nn::Module& model) {
  if (!std::filesystem::is_directory(path)) {
    load_state_dict(read_weights_file(path), model, path);
  } else if (auto hf = read_hf_weights(path)) {
    load_state_dict(std::move(*hf), model, path);
  } else {
    load_state_dict(read_dcp_weights(path, model), model, path);
  }
}

void load_state_dict(std::map<std::string, at::Tensor> loaded, torch::nn::Module& model,
                     const std::string& path) {
  std::vector<std::string> missing, shapes;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const auto& [name, t] : state_of(model)) {
    auto it = loaded.find(name);
    if (it == loaded.end()) {
      missing.push_back(name);
      continue;
    }
    if (it->second.sizes() != t.sizes()) {
      shapes.push_back(name + " (file " + c10::str(it->second.sizes()) + ", model " +
                       c10::str(t.sizes()) + ")");
    } else {
      copies.emplace_back(t, it->second);
    }
    loaded.erase(it);
  }
  std::vector<std::string> unexpected;
  for (const auto& kv : loaded) unexpected.push_back(kv.first);
  if (!missing.empty() || !unexpected.empty() || !shapes.empty()) {
    std::string msg = "the weights in '" + path + "' do not fit the model:";
    if (!missing.empty()) msg += " missing keys: " + list(missing) + ";";
    if (!unexpected.empty()) msg += " unexpected keys: " + list(unexpected) + ";";
    if (!shapes.empty()) msg += " shape mismatches: " + list(shapes) + ";";
    throw Error(msg + " were they saved from another model or with other options?");
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(src);
}

}  // namespace scaletrain
