// Note [Rank streams]
// ~~~~~~~~~~~~~~~~~~~
// Two faults this fixes: every rank was seeded alike, so under DDP all ranks drew the same
// dropout masks on different data; and the checkpoint held no generator state, so a model with
// dropout, killed and resumed, drew other masks from the resume on and left the straight run's
// curve. Now rank r's stream starts at rank_seed(seed, r) (the trainer: r / t, one stream per
// tensor-parallel group of t ranks, whose dropout must draw alike), and a checkpoint holds every
// rank's generators: gathered to every rank in one collective (rank 0 writes them), each rank's
// packed as doubles (bytes are small whole numbers: exact) behind a header of its lengths.

#include "scaletrain/rng.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <mutex>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

// splitmix64's finaliser: neighbouring inputs give unrelated outputs.
uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// This rank's states (rng_state(): "rng/cpu", "rng/cuda:<i>") as one double tensor:
// [entries, length of each..., the bytes of each...].
at::Tensor pack(const std::map<std::string, at::Tensor>& states) {
  std::vector<double> head{static_cast<double>(states.size())};
  std::vector<at::Tensor> parts;
  for (const auto& [name, t] : states) {
    const int64_t index = name == "rng/cpu" ? -1 : at::Device(name.substr(4)).index();
    head.push_back(static_cast<double>(index));
    head.push_back(static_cast<double>(t.numel()));
    parts.push_back(t.reshape({-1}).to(at::kDouble));
  }
  parts.insert(parts.begin(), at::tensor(head, at::kDouble));
  return at::cat(parts);
}

void unpack(const at::Tensor& packed, int rank, std::map<std::string, at::Tensor>& out) {
  const auto* p = packed.data_ptr<double>();
  const auto entries = static_cast<int64_t>(p[0]);
  int64_t pos = 1 + 2 * entries;
  for (int64_t e = 0; e < entries; ++e) {
    const auto index = static_cast<int64_t>(p[1 + 2 * e]);
    const auto n = static_cast<int64_t>(p[2 + 2 * e]);
    const std::string name = index < 0 ? "cpu" : "cuda:" + std::to_string(index);
    out["rng/rank" + std::to_string(rank) + "/" + name] =
        packed.slice(0, pos, pos + n).to(at::kByte).clone();
    pos += n;
  }
}

}  // namespace

uint64_t rank_seed(uint64_t seed, int rank) {
  return rank == 0 ? seed : mix(seed ^ mix(static_cast<uint64_t>(rank)));
}

std::map<std::string, at::Tensor> gather_rng_states(const Dist& dist, at::Device via) {
  if (!dist.joined()) {
    throw UsageError("gather_rng_states: the Dist is not joined; call init_process_group()");
  }
  const at::Tensor mine = pack(rng_state()).to(via);
  // Ranks may see different numbers of GPUs: agree on a length first, pad to it.
  auto length = at::zeros({1}, at::TensorOptions(at::kDouble).device(via));
  length.fill_(static_cast<double>(mine.numel()));
  dist.all_reduce(length, ReduceOp::MAX);
  auto padded = at::zeros({static_cast<int64_t>(length.item<double>())}, mine.options());
  padded.slice(0, 0, mine.numel()).copy_(mine);
  std::map<std::string, at::Tensor> out;
  const auto all = dist.all_gather(padded);
  for (int r = 0; r < dist.size(); ++r) unpack(all[static_cast<size_t>(r)].cpu(), r, out);
  out["rng/world"] = at::tensor({static_cast<int64_t>(dist.size())}, at::kLong);
  return out;
}

bool restore_rng_states(const std::map<std::string, at::Tensor>& tensors, const Dist& dist) {
  auto world = tensors.find("rng/world");
  if (world == tensors.end() || world->second.item<int64_t>() != dist.size()) return false;
  const std::string prefix = "rng/rank" + std::to_string(dist.rank()) + "/";
  std::map<std::string, at::Tensor> mine;
  for (const auto& [name, t] : tensors) {
    if (name.rfind(prefix, 0) == 0) mine["rng/" + name.substr(prefix.size())] = t;
  }
  if (mine.find("rng/cpu") == mine.end()) return false;
  restore_rng(mine);
  return true;
}

}  // namespace scaletrain
