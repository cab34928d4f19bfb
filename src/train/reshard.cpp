// Note [Sharded checkpoints at another degree] in reshard.h.

#include "train/reshard.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/scalar_tensor.h>

#include <sstream>

#include "checkpoint/optimizer_state.h"
#include "scaletrain/error.h"
#include "scaletrain/tensor_parallel.h"
#include "train/run_folder.h"

namespace scaletrain {
namespace {

const char* kNamesKey = "tensor_parallel/names";
const char* kSplitKey = "tensor_parallel/split";

// `zero`'s parameters by `zero_model`'s names, in ZeRO's order.
std::vector<std::pair<std::string, std::string>> zero_to_model_names(
    const ShardedDataParallel& zero, torch::nn::Module& zero_model) {
  std::map<const void*, std::string> own;
  for (const auto& p : zero_model.named_parameters())
    own[p.value().unsafeGetTensorImpl()] = p.key();
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [name, t] : zero.named_parameters()) {
    auto it = own.find(t.unsafeGetTensorImpl());
    if (it == own.end())
      throw Error("resharding: ZeRO's parameter '" + name + "' is not the model's");
    out.emplace_back(name, it->second);
  }
  return out;
}

// A map of names written by describe_for_resharding() ("from to" lines), read.
std::map<std::string, std::string> read_names(const std::string& lines) {
  std::map<std::string, std::string> out;
  std::stringstream in(lines);
  for (std::string from, to; in >> from >> to;) out[from] = to;
  return out;
}

// `values` (by ZeRO's names) by the model's, through `names` (none: the same names).
std::map<std::string, at::Tensor> renamed(const std::map<std::string, at::Tensor>& values,
                                          const std::map<std::string, std::string>& names) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [k, v] : values) {
    auto it = names.find(k);
    out[it == names.end() ? k : it->second] = v;
  }
  return out;
}

}  // namespace

void describe_for_resharding(const ShardedDataParallel& zero, torch::nn::Module& zero_model,
                             TrainingState& state) {
  std::string names;
  std::map<std::string, std::string> to_zero;
  for (const auto& [z, m] : zero_to_model_names(zero, zero_model)) {
    names += z + " " + m + "\n";
    to_zero[m] = z;
  }
  state.values[kNamesKey] = names;
  // How each parameter is cut, by ZeRO's names (the slices' files hold those).
  std::string split;
  std::stringstream in(describe_split(zero_model));
  for (std::string name, dim, chunks; in >> name >> dim >> chunks;) {
    auto it = to_zero.find(name);
    split += (it == to_zero.end() ? name : it->second) + " " + dim + " " + chunks + "\n";
  }
  state.values[kSplitKey] = split;
}

WholeShardedCheckpoint read_whole_checkpoint(const std::string& dir, int64_t step, int saved_tp) {
  if (saved_tp <= 1) {
    auto whole = read_sharded_checkpoint(dir, step);
    const auto names = read_names(whole.state.values[kNamesKey]);
    whole.params = renamed(whole.params, names);
    for (auto& [kind, values] : whole.optimizer_state) values = renamed(values, names);
    return whole;
  }
  std::vector<WholeShardedCheckpoint> slices;
  for (int t = 0; t < saved_tp; ++t) {
    slices.push_back(read_sharded_checkpoint(tensor_slice_dir(dir, saved_tp, t), step));
  }
  auto& first = slices.front();
  if (!first.state.values.count(kSplitKey) || !first.state.values.count(kNamesKey)) {
    throw UsageError("the sharded checkpoint of step " + std::to_string(step) + " in '" + dir +
                     "' was saved at TrainerOptions::tensor_parallel.size " +
                     std::to_string(saved_tp) +
                     " without how its slices were cut, so it loads at that degree only: resume "
                     "with TrainerOptions::tensor_parallel.size " +
                     std::to_string(saved_tp));
  }
  const auto split = first.state.values.at(kSplitKey);
  const auto names = read_names(first.state.values.at(kNamesKey));
  auto join = [&](auto pick) {
    std::vector<std::map<std::string, at::Tensor>> parts;
    for (auto& s : slices) parts.push_back(pick(s));
    return renamed(join_slices(parts, split), names);
  };
  WholeShardedCheckpoint out;
  out.state = first.state;
  out.optimizer = first.optimizer;
  out.optimizer_step = first.optimizer_step;
  out.params = join([](WholeShardedCheckpoint& s) { return s.params; });
  for (const auto& kind : first.optimizer_state) {
    out.optimizer_state[kind.first] =
        join([&](WholeShardedCheckpoint& s) { return s.optimizer_state[kind.first]; });
  }
  return out;
}

bool load_whole_checkpoint(const WholeShardedCheckpoint& whole, torch::nn::Module& model,
                           ShardedDataParallel& zero, torch::nn::Module& zero_model,
                           torch::optim::Optimizer& opt,
                           const std::function<std::map<std::string, at::Tensor>(
                               const std::map<std::string, at::Tensor>&)>& cut) {
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model.named_parameters()) {
      auto it = whole.params.find(p.key());
      if (it == whole.params.end() && !p.value().requires_grad()) continue;  // ZeRO keeps none
      if (it == whole.params.end() || it->second.sizes() != p.value().sizes()) {
        throw UsageError(
            "the sharded checkpoint's parameter '" + p.key() + "' is " +
            (it == whole.params.end() ? std::string("missing") : c10::str(it->second.sizes())) +
            "; this model's is " + c10::str(p.value().sizes()) +
            " (a checkpoint of another model, or one saved without the names and cuts that "
            "another degree needs, which loads only at the degree it was saved at)");
      }
      p.value().copy_(it->second);
    }
  }
  if (whole.optimizer_state.empty()) return true;  // saved before the first step: nothing to carry
  if (whole.optimizer != optimizer_kind(opt)) return false;
  const auto order = zero_to_model_names(zero, zero_model);
  std::map<std::string, at::Tensor> full;
  full["step"] = at::scalar_tensor(static_cast<double>(whole.optimizer_step), at::kLong);
  for (const auto& [kind, values] : whole.optimizer_state) {
    const auto mine = cut(values);
    std::vector<at::Tensor> flat;
    for (const auto& [z, name] : order) {
      auto it = mine.find(name);
      if (it == mine.end()) {
        throw UsageError("the sharded checkpoint has no '" + kind + "' of parameter '" + name +
                         "'");
      }
      flat.push_back(it->second.reshape({-1}));
    }
    full[kind] = at::cat(flat);
  }
  zero.load_full_optimizer_state(opt, full);
  return true;
}

}  // namespace scaletrain
