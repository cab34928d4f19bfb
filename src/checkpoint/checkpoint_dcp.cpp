// Note [DCP checkpoints]
// A checkpoint may be a folder `ckpt-<step>/` in PyTorch's distributed checkpoint layout
// (CheckpointLayout::kDcp; distributed_checkpoint.h) instead of the file `ckpt-<step>.st`. Python
// reads it with torch.distributed.checkpoint as it reads its own:
//
//   model.<fqn>                        every parameter and buffer (dcp.save({"model": sd}))
//   optim.state.<fqn>.<kind>,          an SGD, Adam or AdamW over the model's own parameters,
//   optim.param_groups.<i>.<field>     under get_state_dict()'s names
//   scaletrain.optimizer               any other optimizer (or one over other tensors): its
//                                      LibTorch archive, as uint8 bytes
//   scaletrain.<field>                 the training state: model_name, epoch, step_in_epoch,
//                                      global_step, sampler_epoch, sampler_position,
//                                      sampler_dataset_size (ints and strings)
//   scaletrain.tensors.<name>          TrainingState::tensors (generators, a sharded strategy's
//   scaletrain.values.<name>           optimizer...) and TrainingState::values
//
// DCP has no checksums, and a scaletrain checkpoint must tell a damaged copy from a good one
// (newest_valid_checkpoint() skips the damaged): before the folder is renamed into place, a
// record `.scaletrain-checkpoint` joins it, with the run id and each file's size and CRC-32.
// Python ignores it. The folder is written by one process, as the one-file format is (rank 0,
// with what the strategy gathered to it), through the single-process path of
// save_distributed_checkpoint(), and so is atomic: complete, record included, or absent.

#include "checkpoint/checkpoint_dcp.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "checkpoint/optimizer_state.h"
#include "runtime/atomic_file.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
constexpr const char* kRecord = ".scaletrain-checkpoint";
constexpr const char* kRecordMagic = "SCALETRAIN-DCP-CHECKPOINT 1";
const std::string kOptimizerBytes = "optimizer";

DcpKey key(const std::string& field) { return {"scaletrain." + field, {"scaletrain", field}}; }
DcpKey key(const std::string& group, const std::string& name) {
  return {"scaletrain." + group + "." + name, {"scaletrain", group, name}};
}

// Size and CRC-32 of a file; nullopt when it cannot be read.
std::optional<std::pair<uint64_t, uint32_t>> size_and_crc(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return std::nullopt;
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t size = 0;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<uInt>(in.gcount());
    if (got == 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), got);
    size += got;
  }
  return std::pair{size, static_cast<uint32_t>(crc)};
}

struct Record {
  std::string run;
  std::map<std::string, std::pair<uint64_t, uint32_t>> files;
};

void write_record(const std::string& folder, const std::string& run_id) {
  std::ostringstream out;
  out << kRecordMagic << "\nrun " << run_id << "\n";
  for (auto& e : fs::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    const auto sc = size_and_crc(e.path());
    if (!sc) throw Error("cannot read back '" + e.path().string() + "' to record its checksum");
    char line[64];
    std::snprintf(line, sizeof(line), " %llu %08x\n", static_cast<unsigned long long>(sc->first),
                  sc->second);
    out << name << line;
  }
  write_atomically(folder + "/" + kRecord, out.str(), "a checkpoint's record");
}

std::optional<Record> read_record(const std::string& folder, std::string* problem) {
  std::ifstream in(folder + "/" + kRecord);
  std::string magic, run_line, line;
  if (!in || !std::getline(in, magic) || magic != kRecordMagic || !std::getline(in, run_line) ||
      run_line.rfind("run ", 0) != 0) {
    *problem = "has no record of its files (" + std::string(kRecord) +
               "): not a complete scaletrain checkpoint";
    return std::nullopt;
  }
  Record r;
  r.run = run_line.substr(4);
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name, crc;
    uint64_t size = 0;
    if (!(fields >> name >> size >> crc)) {
      *problem = "has a damaged record (" + std::string(kRecord) + ")";
      return std::nullopt;
    }
    r.files[name] = {size, static_cast<uint32_t>(std::stoul(crc, nullptr, 16))};
  }
  return r;
}

// The optimizer under get_state_dict()'s names where it is a standard one over the model's
// parameters, else its archive's bytes.
void add_optimizer(DcpState& out, const torch::nn::Module& model,
                   const torch::optim::Optimizer& opt) {
  if (!optimizer_kind(opt).empty()) {
    try {
      DcpState named = dcp_module_state(model, &opt);
      for (auto& b : named.tensors) {
        if (b.key.name.rfind("optim.", 0) == 0) out.tensors.push_back(std::move(b));
      }
      for (auto& v : named.values) out.values.push_back(std::move(v));
      return;
    } catch (const UsageError&) {
      // parameters that are not the model's: the archive below
    }
  }
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream bytes;
  ar.save_to(bytes);
  const std::string s = bytes.str();
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  out.tensors.push_back({key(kOptimizerBytes), t, t.sizes().vec(), {}});
}

bool has_digits_only(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c));
  });
}

int64_t step_of_name(const fs::path& p) {
  const std::string name = p.filename().string();
  if (p.extension() == ".st") {  // ckpt-<step>.st
    const std::string stem = p.stem().string();
    return stem.rfind("ckpt-", 0) == 0 && has_digits_only(stem.substr(5))
               ? std::stoll(stem.substr(5))
               : -1;
  }
  return is_dcp_checkpoint_name(p.string()) ? std::stoll(name.substr(5)) : -1;
}

}  // namespace

bool is_dcp_checkpoint_name(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  return name.rfind("ckpt-", 0) == 0 && has_digits_only(name.substr(5));
}

DcpState checkpoint_dcp_state(const TrainingState& s, const torch::nn::Module& model,
                              const torch::optim::Optimizer* opt) {
  DcpState out = dcp_module_state(model, nullptr);
  if (opt) add_optimizer(out, model, *opt);
  DcpState training = training_dcp_state(s);
  for (auto& t : training.tensors) out.tensors.push_back(std::move(t));
  for (auto& v : training.values) out.values.push_back(std::move(v));
  return out;
}

DcpState training_dcp_state(const TrainingState& s) {
  DcpState out;
  out.values.emplace_back(key("model_name"), DcpValue::of(s.model_name));
  const std::vector<std::pair<const char*, int64_t>> ints{
      {"epoch", s.epoch},
      {"step_in_epoch", s.step_in_epoch},
      {"global_step", s.global_step},
      {"sampler_epoch", s.sampler.epoch},
      {"sampler_position", s.sampler.position},
      {"sampler_dataset_size", s.sampler.dataset_size}};
  for (const auto& [field, v] : ints) out.values.emplace_back(key(field), DcpValue::of(v));
  for (const auto& [name, t] : s.tensors) {
    const at::Tensor v = t.detach();
    out.tensors.push_back({key("tensors", name), v, v.sizes().vec(), {}});
  }
  for (const auto& [name, v] : s.values)
    out.values.emplace_back(key("values", name), DcpValue::of(v));
  return out;
}

std::string commit_dcp_checkpoint(const std::string& dir, int64_t global_step,
                                  const std::string& run_id, const DcpState& state, int keep,
                                  const std::function<void(const std::string&)>& before_rename) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string folder = dcp_checkpoint_path(dir, global_step);
  DcpSaveOptions so;
  so.replace = true;
  so.before_publish = [&](const std::string& tmp) {
    write_record(tmp, run_id);
    if (before_rename) before_rename(tmp);
  };
  save_distributed_checkpoint(folder, state, Dist{}, so);
  remove_stale_temporaries(dir, "ckpt-");
  prune_checkpoints(dir, run_id, keep);
  return folder;
}

std::string commit_distributed_dcp_checkpoint(const std::string& dir, int64_t global_step,
                                              const std::string& run_id, const DcpState& mine,
                                              int keep, const Dist& dist) {
  std::error_code ec;
  if (dist.rank() == 0) fs::create_directories(dir, ec);
  const std::string folder = dcp_checkpoint_path(dir, global_step);
  DcpSaveOptions so;
  so.replace = true;
  so.before_publish = [&](const std::string& tmp) { write_record(tmp, run_id); };  // rank 0
  save_distributed_checkpoint(folder, mine, dist, so);
  if (dist.rank() == 0) {
    remove_stale_temporaries(dir, "ckpt-");
    prune_checkpoints(dir, run_id, keep);
  }
  return folder;
}

void prune_checkpoints(const std::string& dir, const std::string& run_id, int keep) {
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> ours;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = step_of_name(e.path());
    if (step >= 0 && checkpoint_run(e.path().string()) == run_id) ours.emplace_back(step, e.path());
  }
  std::sort(ours.begin(), ours.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < ours.size(); ++i) {
    fs::remove_all(ours[i].second, ec);
  }
}

std::optional<std::string> dcp_checkpoint_problem(const std::string& folder) {
  std::string problem;
  const auto record = read_record(folder, &problem);
  if (!record) return problem;
  for (const auto& [name, expected] : record->files) {
    const auto got = size_and_crc(fs::path(folder) / name);
    if (!got) return "lacks its file " + name;
    if (got->first != expected.first) {
      return "has " + name + " of " + std::to_string(got->first) + " bytes, not the " +
             std::to_string(expected.first) + " written (truncated?)";
    }
    if (got->second != expected.second) return "is corrupt (checksum mismatch in " + name + ")";
  }
  return std::nullopt;
}

std::optional<std::string> dcp_checkpoint_run(const std::string& folder) {
  std::string problem;
  const auto record = read_record(folder, &problem);
  if (!record) return std::nullopt;
  return record->run;
}

std::optional<std::string> dcp_checkpoint_value(const std::string& folder, const std::string& k) {
  try {
    const auto values = load_distributed_checkpoint_values(folder);
    const auto it = values.find(key("values", k).name);
    if (it == values.end() || it->second.kind != DcpValue::Kind::kString) return std::nullopt;
    return it->second.text;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

namespace {

// The training state's ints and strings; every failure names the folder and the key.
void read_training_values(const std::string& folder, TrainingState& s,
                          const std::string& model_name) {
  const auto values = load_distributed_checkpoint_values(folder);
  auto get = [&](const std::string& field, DcpValue::Kind kind) -> const DcpValue& {
    const auto it = values.find(key(field).name);
    if (it == values.end() || it->second.kind != kind) {
      throw Error("checkpoint '" + folder + "': no '" + key(field).name +
                  "' in it (a distributed checkpoint scaletrain did not write?)");
    }
    return it->second;
  };
  s.model_name = get("model_name", DcpValue::Kind::kString).text;
  if (s.model_name != model_name) {
    throw UsageError("checkpoint '" + folder + "' holds a '" + s.model_name + "' model, not a '" +
                     model_name +
                     "' one: load it into that model, or start from another checkpoint");
  }
  auto integer = [&](const char* field) { return get(field, DcpValue::Kind::kInt).integer; };
  s.epoch = integer("epoch");
  s.step_in_epoch = integer("step_in_epoch");
  s.global_step = integer("global_step");
  s.sampler.epoch = integer("sampler_epoch");
  s.sampler.position = integer("sampler_position");
  s.sampler.dataset_size = integer("sampler_dataset_size");
  const std::string prefix = key("values", "").name;
  for (const auto& [k, v] : values) {
    if (k.rfind(prefix, 0) == 0 && v.kind == DcpValue::Kind::kString)
      s.values[k.substr(prefix.size())] = v.text;
  }
}

// The optimizer from its archive's bytes.
void load_optimizer_bytes(const std::string& folder, const at::Tensor& bytes,
                          torch::optim::Optimizer& opt) {
  const at::Tensor b = bytes.contiguous();
  std::istringstream in(
      std::string(static_cast<const char*>(b.data_ptr()), static_cast<size_t>(b.numel())));
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(in);
    opt.load(ar);
  } catch (const std::exception& e) {
    throw Error("checkpoint '" + folder + "': its optimizer state does not fit this optimizer (" +
                std::string(e.what()).substr(0, 200) +
                "): it was saved with another optimizer or other parameters");
  }
}

// Whether the folder's keys hold an optimizer under get_state_dict()'s names.
bool holds_named_optimizer(const DcpContents& contents) {
  for (const auto& v : contents.values) {
    if (v.rfind("optim.param_groups.", 0) == 0) return true;
  }
  return false;
}

// Note [Foreign DCP folders]: a folder another program wrote, typically Python's
// dcp.save({"model": msd, "optim": osd}) of get_state_dict(model, opt): no record, no
// scaletrain.* key. Its weights (model.<name>) load, and its optimizer state where the
// optimizer is a standard one over the model's parameters; it has no training position, so a
// resume from it starts at epoch 0, step 0 (TrainingState::has_training_state false).
TrainingState load_foreign_dcp_folder(const std::string& folder, const DcpContents& contents,
                                      torch::nn::Module& model, torch::optim::Optimizer* opt,
                                      const std::string& model_name) {
  TrainingState s;
  s.model_name = model_name;
  s.has_training_state = false;
  const bool named = opt && holds_named_optimizer(contents) && !optimizer_kind(*opt).empty();
  torch::NoGradGuard no_grad;
  try {
    load_dcp_module_state(folder, model, named ? opt : nullptr);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) +
                " (a folder another program wrote resumes with the keys of "
                "dcp.save({\"model\": model.state_dict()}); --init-weights also takes the bare "
                "names of dcp.save(model.state_dict()))");
  }
  s.optimizer_restored = named;
  return s;
}

// A folder another program wrote (a .metadata, neither the record nor a scaletrain.* key): its
// contents, read once; nullopt for scaletrain's own. Throws the reader's Error for a damaged
// .metadata.
std::optional<DcpContents> foreign_contents(const std::string& folder) {
  std::error_code ec;
  const fs::path dir(folder);
  if (!fs::is_regular_file(dir / ".metadata", ec) || fs::exists(dir / kRecord, ec)) {
    return std::nullopt;
  }
  DcpContents contents = read_distributed_checkpoint_contents(folder);
  const auto ours = [](const std::string& k) { return k.rfind("scaletrain.", 0) == 0; };
  for (const auto& [k, info] : contents.tensors) {
    if (ours(k)) return std::nullopt;
  }
  if (std::any_of(contents.values.begin(), contents.values.end(), ours)) return std::nullopt;
  return contents;
}

}  // namespace

TrainingState load_dcp_checkpoint(const std::string& folder, torch::nn::Module& model,
                                  torch::optim::Optimizer* opt, const std::string& model_name) {
  if (auto contents = foreign_contents(folder)) {
    return load_foreign_dcp_folder(folder, *contents, model, opt, model_name);
  }
  if (auto problem = dcp_checkpoint_problem(folder)) {
    throw Error("checkpoint '" + folder + "' " + *problem);
  }
  TrainingState s;
  read_training_values(folder, s, model_name);
  const DcpContents contents = read_distributed_checkpoint_contents(folder);
  const bool named_optimizer = holds_named_optimizer(contents);
  const bool bytes = contents.tensors.count(key(kOptimizerBytes).name) > 0;
  {
    torch::NoGradGuard no_grad;
    const bool named = opt && named_optimizer && !optimizer_kind(*opt).empty();
    load_dcp_module_state(folder, model, named ? opt : nullptr);
    s.optimizer_restored = named;
  }
  auto tensors = load_distributed_checkpoint_tensors(folder, "scaletrain.");
  const std::string prefix = "tensors.";
  for (auto& [k, t] : tensors) {
    if (k.rfind(prefix, 0) == 0) s.tensors[k.substr(prefix.size())] = t;
  }
  if (opt && !s.optimizer_restored && bytes) {
    load_optimizer_bytes(folder, tensors.at(kOptimizerBytes), *opt);
    s.optimizer_restored = true;
  }
  s.run_id = dcp_checkpoint_run(folder).value_or("");
  return s;
}

}  // namespace scaletrain
