#include "scaletrain/checkpoint.h"
#include "scaletrain/log.h"

#include <fcntl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_dcp.h"
#include "checkpoint/checkpoint_io.h"
#include "runtime/atomic_file.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFileMagic = "SCALETRAIN-CHECKPOINT 2";
constexpr const char* kFileMagicV1 = "SCALETRAIN-CHECKPOINT 1";  // no run id; still read

struct Header {
  unsigned long crc = 0, size = 0;
  std::string run;
};

// The two header lines; nullopt when they are not a checkpoint's.
std::optional<Header> read_header(std::istream& in, std::string* problem) {
  std::string magic, line;
  std::getline(in, magic);
  std::getline(in, line);
  if (magic != kFileMagic && magic != kFileMagicV1) {
    *problem = "is not a scaletrain checkpoint (bad header)";
    return std::nullopt;
  }
  Header h;
  char run[129] = {};
  const int got = std::sscanf(line.c_str(), "crc32 %lx size %lu run %128s", &h.crc, &h.size, run);
  if (got < 2 || (magic == kFileMagic && got != 3)) {
    *problem = "has a bad header";
    return std::nullopt;
  }
  h.run = run;
  return h;
}

bool valid_run_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
  }
  return true;
}

uint32_t crc_of(const std::string& s) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(s.data()), static_cast<uInt>(s.size())));
}

// Splits a file into its payload, or says what is wrong with it.
std::optional<std::string> payload_of(const std::string& path, std::string* payload) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot be opened";
  std::string problem;
  auto h = read_header(in, &problem);
  if (!h) return problem;
  std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (body.size() < h->size) {
    return "is truncated (" + std::to_string(body.size()) + " of " + std::to_string(h->size) +
           " bytes)";
  }
  if (body.size() > h->size) {
    return "has a damaged header (it says " + std::to_string(h->size) + " bytes follow, and " +
           std::to_string(body.size()) + " do)";
  }
  if (crc_of(body) != h->crc) return "is corrupt (checksum mismatch)";
  if (payload) *payload = std::move(body);
  return std::nullopt;
}

int64_t step_of(const fs::path& p) {
  auto stem = p.stem().string();  // ckpt-<step>
  try {
    return std::stoll(stem.substr(5));
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::string checkpoint_path(const std::string& dir, int64_t global_step) {
  return dir + "/ckpt-" + std::to_string(global_step) + ".st";
}

std::string dcp_checkpoint_path(const std::string& dir, int64_t global_step) {
  return dir + "/ckpt-" + std::to_string(global_step);
}

std::string save_checkpoint(const std::string& dir, const TrainingState& s,
                            const torch::nn::Module& model, const torch::optim::Optimizer* opt,
                            int keep, CheckpointLayout layout) {
  if (layout == CheckpointLayout::kFile) return save_checkpoint(dir, s, model, opt, keep);
  check_run_id(s.run_id);
  return commit_dcp_checkpoint(dir, s.global_step, s.run_id, checkpoint_dcp_state(s, model, opt),
                               keep, nullptr);
}

std::string save_checkpoint(const std::string& dir, const TrainingState& s,
                            const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                            int keep) {
  return save_checkpoint(dir, s, model, &opt, keep);
}

void check_run_id(const std::string& run_id) {
  if (!valid_run_id(run_id)) {
    throw UsageError("checkpoint run id '" + run_id +
                     "' must be 1 to 128 letters, digits, '-' or '_'");
  }
}

std::string checkpoint_payload(const TrainingState& s, const NamedTensors& parameters,
                               const NamedTensors& buffers, const torch::optim::Optimizer* opt) {
  torch::serialize::OutputArchive ar;
  ar.write("model_name", c10::IValue(s.model_name));
  ar.write("epoch", c10::IValue(s.epoch));
  ar.write("step_in_epoch", c10::IValue(s.step_in_epoch));
  ar.write("global_step", c10::IValue(s.global_step));
  ar.write("sampler_epoch", c10::IValue(s.sampler.epoch));
  // The global position (Note [Global position] in sampler.cpp); "sampler_position", a rank's
  // own count, is what files of scaletrain before it hold.
  ar.write("sampler_global_position", c10::IValue(s.sampler.position));
  ar.write("sampler_dataset_size", c10::IValue(s.sampler.dataset_size));
  for (auto& [name, t] : parameters) ar.write("model." + name, t.detach().cpu());
  for (auto& [name, t] : buffers) ar.write("model." + name, t.cpu(), true);
  for (auto& [name, t] : s.tensors) ar.write("extra.tensor." + name, t.detach().cpu(), true);
  for (auto& [name, v] : s.values) ar.write("extra.value." + name, c10::IValue(v));
  if (opt != nullptr) {
    torch::serialize::OutputArchive opt_ar;
    opt->save(opt_ar);
    ar.write("optimizer", opt_ar);
  }
  std::ostringstream payload;
  ar.save_to(payload);
  return payload.str();
}

std::string commit_checkpoint(const std::string& dir, int64_t global_step,
                              const std::string& run_id, const std::string& body, int keep,
                              const std::function<void(const std::string&)>& before_rename) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string final_path = checkpoint_path(dir, global_step);
  char header[64];
  std::snprintf(header, sizeof(header), "crc32 %08x size %zu run ", crc_of(body), body.size());
  std::string file = std::string(kFileMagic) + "\n" + header + run_id + "\n";
  file += body;
  // Each writer its own temporary (every rank may call this; the last rename wins whole), and
  // a failed write leaves none behind.
  write_atomically(final_path, file,
                   "a checkpoint (choose another folder with TrainerOptions::out_dir?)",
                   before_rename);
  // A write killed before its rename left its temporary: gone once its writer is (a minute on).
  remove_stale_temporaries(dir, "ckpt-");
  // Prune this run's checkpoints only: a folder may hold another run's, which are not ours to
  // delete (docs/checkpoint.md).
  prune_checkpoints(dir, run_id, keep);
  return final_path;
}

NamedTensors named_parameters_of(const torch::nn::Module& model) {
  NamedTensors out;
  for (auto& p : model.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

NamedTensors named_buffers_of(const torch::nn::Module& model) {
  NamedTensors out;
  for (auto& b : model.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

std::string save_checkpoint(const std::string& dir, const TrainingState& s,
                            const torch::nn::Module& model, const torch::optim::Optimizer* opt,
                            int keep) {
  check_run_id(s.run_id);
  const std::string body =
      checkpoint_payload(s, named_parameters_of(model), named_buffers_of(model), opt);
  return commit_checkpoint(dir, s.global_step, s.run_id, body, keep, nullptr);
}

std::optional<std::string> checkpoint_run(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return dcp_checkpoint_run(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string problem;
  auto h = read_header(in, &problem);
  if (!h) return std::nullopt;
  return h->run;
}

std::optional<std::string> checkpoint_value(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return dcp_checkpoint_value(path, key);
  std::string body;
  if (payload_of(path, &body)) return std::nullopt;
  torch::serialize::InputArchive ar;
  std::istringstream in(body);
  ar.load_from(in);
  c10::IValue v;
  if (!ar.try_read("extra.value." + key, v) || !v.isString()) return std::nullopt;
  return v.toStringRef();
}

std::optional<std::string> checkpoint_problem(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return dcp_checkpoint_problem(path);
  return payload_of(path, nullptr);
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& opt, const std::string& model_name) {
  auto s = load_checkpoint(path, model, &opt, model_name);
  if (!s.optimizer_restored) throw Error("checkpoint '" + path + "': no 'optimizer' state in it");
  return s;
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer* opt, const std::string& model_name) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return load_dcp_checkpoint(path, model, opt, model_name);
  std::string body;
  if (auto problem = payload_of(path, &body)) throw Error("checkpoint '" + path + "' " + *problem);
  TrainingState s = load_checkpoint_payload(body, path, model, opt, model_name);
  s.run_id = checkpoint_run(path).value_or("");
  return s;
}

TrainingState load_checkpoint_payload(const std::string& body, const std::string& path,
                                      torch::nn::Module& model, torch::optim::Optimizer* opt,
                                      const std::string& model_name) {
  torch::serialize::InputArchive ar;
  std::istringstream in(body);
  ar.load_from(in);
  // Every failure names the file and the key.
  auto value = [&](const std::string& key) {
    c10::IValue v;
    if (!ar.try_read(key, v)) {
      throw Error("checkpoint '" + path + "': no '" + key +
                  "' in it (written by another program?)");
    }
    return v;
  };
  auto into = [&](const std::string& key, const at::Tensor& dst, bool buffer) {
    at::Tensor t;
    if (!ar.try_read(key, t, buffer)) {
      throw Error("checkpoint '" + path + "': no '" + key + "' in it; the model has a " +
                  (buffer ? "buffer" : "parameter") + " the checkpoint's model had not");
    }
    if (t.sizes() != dst.sizes()) {
      throw Error("checkpoint '" + path + "': '" + key + "' is " + c10::str(t.sizes()) +
                  " in the file and " + c10::str(dst.sizes()) +
                  " in the model: the checkpoint is of a model built with other options");
    }
    dst.copy_(t);
  };
  TrainingState s;
  s.model_name = value("model_name").toStringRef();
  if (s.model_name != model_name) {
    throw UsageError("checkpoint '" + path + "' holds a '" + s.model_name + "' model, not a '" +
                     model_name +
                     "' one: load it into that model, or start from another checkpoint");
  }
  s.epoch = value("epoch").toInt();
  s.step_in_epoch = value("step_in_epoch").toInt();
  s.global_step = value("global_step").toInt();
  s.sampler.epoch = value("sampler_epoch").toInt();
  c10::IValue global, size;
  if (ar.try_read("sampler_global_position", global)) {
    s.sampler.position = global.toInt();
    if (ar.try_read("sampler_dataset_size", size)) s.sampler.dataset_size = size.toInt();
  } else {  // an older file: a rank's own count, exact only at the world it was saved at
    s.sampler.position = value("sampler_position").toInt();
    s.values["scaletrain/sampler_position_per_rank"] = "1";
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model.named_parameters()) into("model." + p.key(), p.value(), false);
    for (auto& b : model.named_buffers()) into("model." + b.key(), b.value(), true);
  }
  for (const auto& key : ar.keys()) {
    const std::string tensor_prefix = "extra.tensor.", value_prefix = "extra.value.";
    if (key.rfind(tensor_prefix, 0) == 0) {
      at::Tensor t;
      ar.read(key, t, true);
      s.tensors[key.substr(tensor_prefix.size())] = t;
    } else if (key.rfind(value_prefix, 0) == 0) {
      s.values[key.substr(value_prefix.size())] = value(key).toStringRef();
    }
  }
  torch::serialize::InputArchive opt_ar;
  if (opt == nullptr || !ar.try_read("optimizer", opt_ar)) return s;
  try {
    opt->load(opt_ar);
    s.optimizer_restored = true;
  } catch (const std::exception& e) {
    throw Error("checkpoint '" + path + "': its optimizer state does not fit this optimizer (" +
                std::string(e.what()).substr(0, 200) +
                "): it was saved with another optimizer or other parameters");
  }
  return s;
}

std::map<std::string, at::Tensor> rng_state() {
  std::map<std::string, at::Tensor> out;
  out["rng/cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  for (int i = 0; i < cuda_device_count(); ++i) {
    const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(i));
    out["rng/" + dev.str()] = at::globalContext().defaultGenerator(dev).get_state();
  }
  return out;
}

void restore_rng(const std::map<std::string, at::Tensor>& tensors) {
  for (const auto& [name, state] : tensors) {
    at::Generator gen;
    if (name == "rng/cpu") {
      gen = at::detail::getDefaultCPUGenerator();
    } else if (name.rfind("rng/cuda:", 0) == 0) {
      const at::Device dev(name.substr(4));
      if (dev.index() >= cuda_device_count()) continue;  // saved with more GPUs than visible
      gen = at::globalContext().defaultGenerator(dev);
    } else {
      continue;
    }
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

void report_skipped(const std::string& what) {
  // Once per process and file: a run looks for its checkpoint several times while it starts.
  static std::mutex mu;
  static std::set<std::string> reported;
  std::lock_guard<std::mutex> lock(mu);
  if (reported.insert(what).second) log_line(LogLevel::kWarning, "skipping " + what);
}

std::optional<std::string> newest_valid_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  std::vector<fs::path> all;
  for (auto& e : fs::directory_iterator(dir)) {
    const bool file = e.path().extension() == ".st" && step_of(e.path()) >= 0;
    const bool folder = is_dcp_checkpoint_name(e.path().string()) && e.is_directory(ec);
    if (file || folder) all.push_back(e.path());
  }
  std::sort(all.begin(), all.end(), [](auto& a, auto& b) { return step_of(a) > step_of(b); });
  for (auto& p : all) {
    if (auto problem = checkpoint_problem(p.string())) {
      report_skipped("checkpoint " + p.string() + ": it " + *problem);
      continue;
    }
    return p.string();
  }
  return std::nullopt;
}

}  // namespace scaletrain
