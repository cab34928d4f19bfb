// Sharded checkpoints (docs/zero.md, "Checkpoints"). Every rank writes its own file,
// `dir/world-<N>/rank-<r>/ckpt-<step>.st`, in the checkpoint format of checkpoint.h (atomic,
// CRC-32), holding its shard of each unit's parameters and optimizer state
// ("zero/unit<u>/param", "zero/unit<u>/exp_avg"...) and the layout they were cut from (the
// world, each unit's size and padding, the parameters' names and sizes).
//
// Loading at M ranks what N ranks saved (resharding): the units' slices of every saved file,
// without their padding, put back to back, are the model's parameters (or one optimizer
// moment) flat in parameter order, whatever N and whatever unit sizes were used; each rank cuts
// its own units and shards out of that. When N = M and the layout is the same, a rank reads only
// its own file.

#include <ATen/ops/cat.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <sstream>

#include "checkpoint/optimizer_state.h"
#include "dist/model_sync.h"
#include "scaletrain/error.h"
#include "zero/impl.h"

namespace scaletrain {
namespace fs = std::filesystem;
namespace {

constexpr const char* kShardModel = "scaletrain-zero-shard";

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (auto& l : lines) out += l + "\n";
  return out;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

std::string shard_dir(const std::string& dir, int world, int rank) {
  return dir + "/world-" + std::to_string(world) + "/rank-" + std::to_string(rank);
}

std::string value_of(const TrainingState& s, const std::string& key, const std::string& path) {
  auto it = s.values.find(key);
  if (it == s.values.end()) {
    throw Error("sharded checkpoint '" + path + "': no '" + key + "' in it (not a shard?)");
  }
  return it->second;
}

// The worlds that saved `step` in `dir`, with every rank's file present and sound. `damaged`,
// when given, gets a line for each world left out for a file that is there but unsound.
std::vector<int> complete_worlds(const std::string& dir, int64_t step,
                                 std::vector<std::string>* damaged = nullptr) {
  std::vector<int> worlds;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind("world-", 0) != 0) continue;
    int n = 0;
    try {
      n = std::stoi(name.substr(6));
    } catch (const std::exception&) {
      continue;
    }
    bool ok = n > 0;
    std::optional<std::string> run;
    for (int r = 0; ok && r < n; ++r) {
      const auto path = checkpoint_path(shard_dir(dir, n, r), step);
      const auto problem = fs::exists(path) ? checkpoint_problem(path) : std::nullopt;
      if (problem && damaged) {
        damaged->push_back("the sharded checkpoint of step " + std::to_string(step) + " saved by " +
                           std::to_string(n) + " ranks: rank " + std::to_string(r) + "'s file " +
                           path + " " + *problem);
      }
      ok = fs::exists(path) && !problem;
      if (!ok) break;
      auto this_run = checkpoint_run(path);
      if (r == 0) run = this_run;
      ok = this_run == run;
    }
    if (ok) worlds.push_back(n);
  }
  return worlds;
}

// This rank's shard of each unit of `plan` from `all`, the model's values flat in parameter order.
std::vector<at::Tensor> cut(const at::Tensor& all, const std::vector<UnitRange>& plan, int rank,
                            int world) {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& u : plan) {
    auto padded = at::zeros({u.padded}, all.options());
    padded.narrow(0, 0, u.numel).copy_(all.narrow(0, offset, u.numel));
    const int64_t s = u.padded / world;
    out.push_back(padded.narrow(0, rank * s, s).clone());
    offset += u.numel;
  }
  return out;
}

}  // namespace

std::map<std::string, at::Tensor> ShardedDataParallel::full_optimizer_state(
    const torch::optim::Optimizer& opt) const {
  std::map<std::string, std::vector<at::Tensor>> parts;
  std::map<std::string, at::Tensor> out;
  for (size_t u = 0; u < plan_.size(); ++u) {
    auto st = param_state(opt, shards_[u]);
    if (!st) continue;
    out["step"] = at::scalar_tensor(static_cast<double>(st->step), at::kLong);
    for (auto& [k, t] : st->tensors) {
      auto full = dist_.size() > 1 ? dist_.all_gather_into_tensor(t.contiguous()) : t;
      parts[k].push_back(full.narrow(0, 0, plan_[u].numel));
    }
  }
  for (auto& [k, v] : parts) {
    if (v.size() != plan_.size()) {
      throw Error("rank " + std::to_string(dist_.rank()) + ": the optimizer has '" + k + "' for " +
                  std::to_string(v.size()) + " of " + std::to_string(plan_.size()) + " units");
    }
    out[k] = at::cat(v).cpu();
  }
  return out;
}

void ShardedDataParallel::load_full_optimizer_state(
    torch::optim::Optimizer& opt, const std::map<std::string, at::Tensor>& state) {
  int64_t total = 0;
  for (auto& u : plan_) total += u.numel;
  std::map<std::string, std::vector<at::Tensor>> pieces;
  int64_t step = 0;
  for (auto& [k, t] : state) {
    if (k == "step") {
      step = t.item<int64_t>();
      continue;
    }
    if (t.dim() != 1 || t.numel() != total) {
      throw UsageError("rank " + std::to_string(dist_.rank()) + ": optimizer state '" + k +
                       "' holds " + std::to_string(t.numel()) + " values; the model has " +
                       std::to_string(total) + " parameters");
    }
    pieces[k] = cut(t, plan_, dist_.rank(), dist_.size());
  }
  if (pieces.empty()) return;
  for (size_t u = 0; u < plan_.size(); ++u) {
    ParamState st;
    st.step = step;
    for (auto& [k, v] : pieces) st.tensors[k] = v[u].to(shards_[u].device());
    set_param_state(opt, shards_[u], st);
  }
}

std::string ShardedDataParallel::save(const std::string& dir, const TrainingState& state,
                                      const torch::optim::Optimizer& opt, int keep,
                                      AsyncCheckpointer* writer) const {
  const auto kind = optimizer_kind(opt);
  if (kind.empty()) {
    throw UsageError("rank " + std::to_string(dist_.rank()) +
                     ": ShardedDataParallel::save knows the state of torch::optim::SGD, Adam and "
                     "AdamW; keep another optimizer's state in TrainingState::tensors yourself");
  }
  TrainingState s = state;
  s.values["zero/model_name"] = state.model_name;
  s.model_name = kShardModel;
  s.values["zero/world"] = std::to_string(dist_.size());
  s.values["zero/optimizer"] = kind;
  std::vector<std::string> units;
  s.values["zero/params"] = join(impl_->described_params());
  for (size_t u = 0; u < plan_.size(); ++u) {
    units.push_back(std::to_string(plan_[u].numel));
    const auto& shard = shards_[u];
    const auto prefix = "zero/unit" + std::to_string(u) + "/";
    s.tensors[prefix + "param"] = shard.detach();
    if (auto st = param_state(opt, shard)) {
      s.values[prefix + "step"] = std::to_string(st->step);
      for (auto& [name, t] : st->tensors) s.tensors[prefix + name] = t;
    }
  }
  s.values["zero/units"] = join(units);
  torch::nn::Module none;
  const auto own = shard_dir(dir, dist_.size(), dist_.rank());
  if (writer != nullptr) return writer->save(own, s, none, nullptr, keep);
  auto path = save_checkpoint(own, s, none, nullptr, keep);
  dist_.barrier();  // every shard is on disk when save() returns
  return path;
}

namespace {

// Every state kind ("param", "exp_avg"...) of every unit of this rank, and the optimizer's step.
struct Pieces {
  std::map<std::string, std::vector<at::Tensor>> of;  // kind -> per unit of this rank
  int64_t step = 0;
};

// The world whose files load(): this world's own layout if it saved the step, else the largest
// world that did (which needs `reshard`).
int world_to_load(const std::string& dir, int64_t global_step, int world, bool reshard,
                  const std::string& who) {
  auto worlds = complete_worlds(dir, global_step);
  if (worlds.empty()) {
    throw Error(who + "no complete sharded checkpoint of step " + std::to_string(global_step) +
                " in '" + dir + "' (every rank's " + dir + "/world-N/rank-R/ckpt-" +
                std::to_string(global_step) + ".st, sound and of one run)");
  }
  int saved = *std::max_element(worlds.begin(), worlds.end());
  if (std::find(worlds.begin(), worlds.end(), world) != worlds.end()) saved = world;
  if (saved != world && !reshard) {
    throw UsageError(who + "the checkpoint of step " + std::to_string(global_step) + " in '" + dir +
                     "' was saved by " + std::to_string(saved) + " ranks, this world has " +
                     std::to_string(world) + "; load it with reshard = true");
  }
  return saved;
}

// The saved file is of the same model (`described`, parameter by parameter) and optimizer.
void check_same_model(const TrainingState& file, const std::string& path,
                      const std::vector<std::string>& described, const std::string& optimizer,
                      const std::string& who) {
  const auto theirs = lines_of(value_of(file, "zero/params", path));
  for (size_t i = 0; i < std::max(theirs.size(), described.size()); ++i) {
    const auto a = i < theirs.size() ? theirs[i] : "(none)";
    const auto b = i < described.size() ? described[i] : "(none)";
    if (a == b) continue;
    throw UsageError(who + "sharded checkpoint '" + path + "' is of another model: parameter #" +
                     std::to_string(i) + " is '" + a + "' there and '" + b + "' here");
  }
  const auto kind = value_of(file, "zero/optimizer", path);
  if (kind != optimizer) {
    throw UsageError(who + "sharded checkpoint '" + path + "' holds the state of a '" + kind +
                     "' optimizer, not of a '" + optimizer + "' one");
  }
}

// Same world, same layout: this rank's own file holds its units as they are.
Pieces own_pieces(const TrainingState& file, size_t units) {
  Pieces p;
  for (size_t u = 0; u < units; ++u) {
    const auto prefix = "zero/unit" + std::to_string(u) + "/";
    for (auto& [key, t] : file.tensors) {
      if (key.rfind(prefix, 0) == 0) p.of[key.substr(prefix.size())].push_back(t);
    }
    auto it = file.values.find(prefix + "step");
    if (it != file.values.end()) p.step = std::stoll(it->second);
  }
  return p;
}

// Every saved rank's `files`, their units' slices without padding back to back: the model's
// values of each kind ("param", "exp_avg"...) flat in parameter order, and the optimizer's step.
struct Flat {
  std::map<std::string, at::Tensor> of;
  int64_t step = 0;
};
Flat flat_values(const std::vector<TrainingState>& files, const std::vector<std::string>& paths,
                 const std::string& who) {
  std::vector<int64_t> saved_units;
  for (auto& l : lines_of(value_of(files[0], "zero/units", paths[0]))) {
    saved_units.push_back(std::stoll(l));
  }
  for (size_t f = 1; f < files.size(); ++f) {
    if (value_of(files[f], "zero/units", paths[f]) != value_of(files[0], "zero/units", paths[0]) ||
        files[f].run_id != files[0].run_id) {
      throw Error(who + "shard '" + paths[f] + "' does not belong with '" + paths[0] +
                  "' (another run or another layout)");
    }
  }
  Flat out;
  std::set<std::string> kinds;
  for (auto& [key, t] : files[0].tensors) {
    if (key.rfind("zero/unit0/", 0) == 0) kinds.insert(key.substr(11));
  }
  auto it = files[0].values.find("zero/unit0/step");
  if (it != files[0].values.end()) out.step = std::stoll(it->second);
  for (const auto& k : kinds) {
    std::vector<at::Tensor> flat;
    for (size_t v = 0; v < saved_units.size(); ++v) {
      std::vector<at::Tensor> slices;
      for (size_t f = 0; f < files.size(); ++f) {
        const auto key = "zero/unit" + std::to_string(v) + "/" + k;
        auto t = files[f].tensors.find(key);
        if (t == files[f].tensors.end()) {
          throw Error(who + "shard '" + paths[f] + "': no '" + key + "' in it");
        }
        slices.push_back(t->second);
      }
      flat.push_back(at::cat(slices).narrow(0, 0, saved_units[v]));
    }
    out.of[k] = at::cat(flat);
  }
  return out;
}

// Resharding: the saved values flat, cut into this rank's units.
Pieces resharded_pieces(const std::vector<TrainingState>& files,
                        const std::vector<std::string>& paths, const std::vector<UnitRange>& plan,
                        int rank, int world, const std::string& who) {
  Flat flat = flat_values(files, paths, who);
  Pieces p;
  p.step = flat.step;
  for (auto& [k, all] : flat.of) p.of[k] = cut(all, plan, rank, world);
  return p;
}

// A parameter as the shard describes it (describe_param: "name dtype [d0, d1, ...]").
std::pair<std::string, std::vector<int64_t>> described_shape(const std::string& line,
                                                             const std::string& path) {
  const auto name_end = line.find(' ');
  const auto open = line.find('[');
  const auto close = line.rfind(']');
  if (name_end == std::string::npos || open == std::string::npos || close < open) {
    throw Error("sharded checkpoint '" + path + "': parameter line '" + line + "' is unreadable");
  }
  std::vector<int64_t> sizes;
  std::stringstream in(line.substr(open + 1, close - open - 1));
  for (std::string d; std::getline(in, d, ',');) sizes.push_back(std::stoll(d));
  return {line.substr(0, name_end), sizes};
}

// What load() returns: the file's state without the shard's own keys.
TrainingState caller_state(TrainingState out, const std::string& path) {
  out.model_name = value_of(out, "zero/model_name", path);
  for (auto it = out.values.begin(); it != out.values.end();) {
    it = it->first.rfind("zero/", 0) == 0 ? out.values.erase(it) : std::next(it);
  }
  for (auto it = out.tensors.begin(); it != out.tensors.end();) {
    it = it->first.rfind("zero/", 0) == 0 ? out.tensors.erase(it) : std::next(it);
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> ShardedDataParallel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < impl_->params.size(); ++i)
    out.emplace_back(impl_->names[i], impl_->params[i]);
  return out;
}

std::vector<std::string> ShardedDataParallel::Impl::described_params() const {
  std::vector<std::string> described;
  for (size_t i = 0; i < params.size(); ++i) {
    described.push_back(  // the masters' dtype, whatever the module computes in
        describe_param(names[i], master_dtype, params[i].sizes()));
  }
  return described;
}

TrainingState ShardedDataParallel::load(const std::string& dir, int64_t global_step,
                                        torch::optim::Optimizer& opt, bool reshard) {
  const std::string who = "rank " + std::to_string(dist_.rank()) + ": ";
  const int saved = world_to_load(dir, global_step, dist_.size(), reshard, who);
  // The files this rank needs: its own when the layout is the same, else every one.
  std::vector<std::string> own_units;
  for (auto& u : plan_) own_units.push_back(std::to_string(u.numel));
  torch::nn::Module none;
  std::vector<TrainingState> files;
  std::vector<std::string> paths;
  auto read = [&](int r) {
    paths.push_back(checkpoint_path(shard_dir(dir, saved, r), global_step));
    files.push_back(load_checkpoint(paths.back(), none, nullptr, kShardModel));
  };
  read(saved == dist_.size() ? dist_.rank() : 0);
  const bool same_layout =
      saved == dist_.size() && value_of(files[0], "zero/units", paths[0]) == join(own_units);
  check_same_model(files[0], paths[0], impl_->described_params(), optimizer_kind(opt), who);
  Pieces pieces;
  if (same_layout) {
    pieces = own_pieces(files[0], plan_.size());
  } else {
    files.clear();
    paths.clear();
    for (int r = 0; r < saved; ++r) read(r);
    pieces = resharded_pieces(files, paths, plan_, dist_.rank(), dist_.size(), who);
  }

  at::NoGradGuard no_grad;
  for (size_t u = 0; u < plan_.size(); ++u) {
    auto& shard = shards_[u];
    shard.detach().copy_(pieces.of.at("param")[u]);
    ParamState st;
    st.step = pieces.step;
    for (auto& [k, v] : pieces.of) {
      if (k != "param") st.tensors[k] = v[u].to(shard.device()).clone();
    }
    if (!st.tensors.empty()) set_param_state(opt, shard, st);
  }
  if (options_.stage < 3) {
    impl_->gather_all();
  } else {
    this->reshard();
  }
  TrainingState out = caller_state(files[0], paths[0]);
  out.optimizer_restored = pieces.of.size() > 1;
  return out;
}

std::vector<int64_t> sharded_checkpoint_steps(const std::string& dir) {
  std::set<int64_t> steps;
  std::error_code ec;
  for (auto& w : fs::directory_iterator(dir, ec)) {
    const auto rank0 = w.path() / "rank-0";
    std::error_code ec2;
    for (auto& f : fs::directory_iterator(rank0, ec2)) {
      const auto name = f.path().filename().string();
      if (name.rfind("ckpt-", 0) != 0 || f.path().extension() != ".st") continue;
      try {
        steps.insert(std::stoll(name.substr(5)));
      } catch (const std::exception&) {
      }
    }
  }
  return {steps.rbegin(), steps.rend()};
}

bool sharded_checkpoint_complete(const std::string& dir, int64_t step) {
  std::vector<std::string> damaged;
  const bool complete = !complete_worlds(dir, step, &damaged).empty();
  for (const auto& d : damaged) report_skipped(d);
  return complete;
}

WholeShardedCheckpoint read_sharded_checkpoint(const std::string& dir, int64_t global_step) {
  auto worlds = complete_worlds(dir, global_step);
  if (worlds.empty()) {
    throw Error("no complete sharded checkpoint of step " + std::to_string(global_step) + " in '" +
                dir + "' (every rank's " + dir + "/world-N/rank-R/ckpt-" +
                std::to_string(global_step) + ".st, sound and of one run)");
  }
  const int saved = *std::max_element(worlds.begin(), worlds.end());
  torch::nn::Module none;
  std::vector<TrainingState> files;
  std::vector<std::string> paths;
  for (int r = 0; r < saved; ++r) {
    paths.push_back(checkpoint_path(shard_dir(dir, saved, r), global_step));
    files.push_back(load_checkpoint(paths.back(), none, nullptr, kShardModel));
  }
  Flat flat = flat_values(files, paths, "");
  WholeShardedCheckpoint out;
  out.optimizer = value_of(files[0], "zero/optimizer", paths[0]);
  out.optimizer_step = flat.step;
  int64_t offset = 0;
  for (const auto& line : lines_of(value_of(files[0], "zero/params", paths[0]))) {
    auto [name, sizes] = described_shape(line, paths[0]);
    int64_t numel = 1;
    for (auto d : sizes) numel *= d;
    for (auto& [kind, all] : flat.of) {
      if (offset + numel > all.numel()) {
        throw Error("sharded checkpoint '" + paths[0] +
                    "': its parameters hold more values than "
                    "its units");
      }
      auto value = all.narrow(0, offset, numel).view(sizes).clone();
      if (kind == "param") {
        out.params[name] = value;
      } else {
        out.optimizer_state[kind][name] = value;
      }
    }
    offset += numel;
  }
  out.state = caller_state(files[0], paths[0]);
  return out;
}

std::optional<int64_t> newest_sharded_checkpoint(const std::string& dir) {
  for (int64_t step : sharded_checkpoint_steps(dir)) {
    if (sharded_checkpoint_complete(dir, step)) return step;
  }
  return std::nullopt;
}

}  // namespace scaletrain
