// Note [Strategies]
// ~~~~~~~~~~~~~~~~~
// The trainer's loop (trainer.cpp) is one for every strategy; a strategy says what a step is on
// this rank and what the rank holds:
//
//   strategy  processes       a rank holds                      its optimizer steps
//   ddp       one per device  the model, DDP over the ranks     the model's parameters
//   dp        one             a replica per device (primary     the primary's = the model's
//                             = the model)
//   pipeline  one             the model's blocks, in stages     the model's (the blocks share
//                             over the devices                  its tensors)
//   grid      stages x        one stage of one pipeline; DDP    its stage's parameters
//             replicas        over that stage's replicas (the
//                             mesh {dp, pp}, mesh.h)
//   zero1     one per device  the model; the optimizer state    its shard of every unit
//                             sharded over the ranks (zero.h)
//   zero2     one per device  ... and the gradients             its shard of every unit
//   fsdp      one per device  ... and the parameters: units     its shard of every unit
//                             gathered for their forward and
//                             backward only
//
// Tensor parallelism (TrainerOptions::tensor_parallel.size > 1) is applied before the others
// (Note [Tensor parallelism applied first] in tp_apply.h): ddp, zero1, zero2 and fsdp then run
// over the dp groups of the mesh {dp, tp}, and the grid splits each stage.
//
// Every checkpoint holds the whole model's weights under PyTorch's names and the optimizer's
// state as that of the same SGD, Adam or AdamW over them (Note [Standard optimizer state] in
// optimizer_states.h): ddp, dp and pipeline step such an optimizer; ZeRO's shards, the slices of
// tensor parallelism and a grid's stages are joined into it on a save and cut from it on a load.
// So a run trained with one strategy resumes with any other, at any world size and layout,
// where it left off; --checkpoint-format sharded writes a file per rank instead (zero1, zero2,
// fsdp).

#include "train/strategy.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <sys/resource.h>
#include <torch/nn/functional/loss.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>

#include "scaletrain/data_parallel.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/intra_op_threads.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/version.h"
#include "train/balance.h"
#include "train/loss_sums.h"

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace scaletrain {

at::Device rank_device(const std::optional<at::Device>& chosen, const Dist& d) {
  const int gpus = cuda_device_count();
  if ((chosen && chosen->is_cpu()) || (!chosen && gpus == 0)) return at::kCPU;
  if (gpus == 0) {
    throw UsageError("TrainerOptions::device " + chosen->str() + " on rank " +
                     std::to_string(d.rank()) +
                     ", but no GPU is visible; use TrainerOptions::device cpu");
  }
  if (!chosen || !chosen->has_index())
    return {at::kCUDA, static_cast<int8_t>(d.world.local_rank % gpus)};
  if (chosen->index() >= gpus) {
    throw UsageError("TrainerOptions::device " + chosen->str() + ": this node has " +
                     std::to_string(gpus) + " GPU(s)");
  }
  return *chosen;
}

std::vector<at::Device> local_devices(const TrainerOptions& o) {
  std::vector<at::Device> out = o.devices;
  if (!out.empty()) return out;
  const int gpus = cuda_device_count();
  if (gpus >= 2) {
    for (int i = 0; i < gpus; ++i) out.emplace_back(at::kCUDA, static_cast<int8_t>(i));
    return out;
  }
  return {at::kCPU, at::kCPU};
}

int64_t peak_memory(const at::Device& dev) {
#ifdef SCALETRAIN_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .peak;
  }
#endif
  (void)dev;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // the process's peak resident memory
}

// One flag per tensor, gathered on the first one's device: one wait for the host, not one per
// tensor (regression OneDeviceSyncPerParameter: each flag was copied to the CPU on its own, and
// on a GPU every copy waited for the device, 62 waits per step of a ResNet-18).
at::Tensor all_finite_flag(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    auto flag = at::isfinite(t).all();
    flags.push_back(flags.empty() ? flag : flag.to(flags.front().device()));
  }
  return flags.empty() ? at::ones({}, at::kBool) : at::stack(flags).all();
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  return all_finite_flag(tensors).item<bool>();
}

bool TrainStrategy::gradients_finite() {
  std::vector<at::Tensor> grads;
  for (auto& p : parameters()) grads.push_back(p.grad());
  return all_finite(grads);  // averaged gradients: the same bits on every rank
}

at::Tensor archive_bytes(torch::serialize::OutputArchive& ar) {
  std::ostringstream out;
  ar.save_to(out);
  const std::string s = out.str();
  auto t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

void load_archive_bytes(const at::Tensor& bytes, torch::serialize::InputArchive& ar) {
  const auto t = bytes.contiguous().cpu();
  std::istringstream in(
      std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel())));
  ar.load_from(in);
}

at::Tensor optimizer_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  return archive_bytes(ar);
}

void load_optimizer_bytes(torch::optim::Optimizer& opt, const at::Tensor& bytes) {
  torch::serialize::InputArchive ar;
  load_archive_bytes(bytes, ar);
  opt.load(ar);
}

std::vector<at::Tensor> bytes_to_rank_zero(const Dist& dist, const at::Tensor& mine, int senders,
                                           int tag, const at::Device& device) {
  if (dist.rank() != 0) {
    dist.send(at::full({1}, mine.numel(), at::kLong).to(device), 0, tag, "bytes' size to rank 0");
    dist.send(mine.to(device), 0, tag + 1, "bytes to rank 0");
    return {};
  }
  std::vector<at::Tensor> out = {mine};
  for (int r = 1; r < senders; ++r) {
    const std::string from = " from rank " + std::to_string(r);
    auto size = at::empty({1}, at::TensorOptions(at::kLong).device(device));
    dist.recv(size, r, tag, "bytes' size" + from);
    auto bytes =
        at::empty({size.cpu().item<int64_t>()}, at::TensorOptions(at::kByte).device(device));
    dist.recv(bytes, r, tag + 1, "bytes" + from);
    out.push_back(bytes.cpu());
  }
  return out;
}

double square_sum(const std::vector<at::Tensor>& tensors) {
  std::map<std::string, std::vector<at::Tensor>> by_device;  // one sync per device
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      by_device[t.device().str()].push_back(t.to(at::kDouble).square().sum());
    }
  }
  double sum = 0;
  for (auto& [device, parts] : by_device) sum += at::stack(parts).sum().item<double>();
  return sum;
}

double sum_over(const Dist& dist, double mine, const at::Device& device) {
  auto sum = at::full({1}, mine, at::TensorOptions().dtype(at::kDouble).device(device));
  dist.all_reduce(sum);
  return sum.item<double>();
}

bool on_every_rank(const Dist& dist, bool mine, const at::Device& device) {
  auto ok = at::full({1}, mine ? 1.0 : 0.0, at::TensorOptions().device(device));
  dist.all_reduce(ok, ReduceOp::MIN);
  return ok.item<double>() > 0.5;
}

at::Tensor flat_copy(const std::vector<at::Tensor>& tensors, const at::Device& device) {
  std::vector<at::Tensor> parts;
  parts.reserve(tensors.size());
  for (const auto& t : tensors) parts.push_back(t.detach().to(device).reshape({-1}));
  return at::cat(parts);
}

void copy_from_flat(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

void broadcast_parameters(torch::nn::Module& module, const Dist& dist, const at::Device& device) {
  std::vector<at::Tensor> params = module.parameters();
  auto flat = flat_copy(params, device);
  dist.broadcast(flat, 0);
  torch::NoGradGuard no_grad;
  copy_from_flat(flat, params);
}

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(source[p.key()]);
}

std::map<std::string, at::Tensor> named_values(torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

Model split_build(const TrainTask& task, Model& whole, const Dist& world, const Dist& tp,
                  bool sequence_parallel, const at::Device& device) {
  Model split = task.model();
  if (tp.size() > 1 && !split.parallelize) {
    throw UsageError("tensor parallelism: model '" + split.name +
                     "' cannot be split (its Model has no parallelize; build its linear layers "
                     "as ParallelLinear and give Model::parallelize, tensor_parallel.h)");
  }
  broadcast_parameters(*whole.module, world, device);  // rank 0's weights everywhere
  copy_parameters(*whole.module, *split.module);
  if (tp.size() > 1) split.parallelize(tp, sequence_parallel);  // then this rank's slices
  return split;
}

std::set<const void*> replicated_set(torch::nn::Module& split) {
  std::set<const void*> out;
  for (const auto& p : replicated_parameters(split)) out.insert(p.unsafeGetTensorImpl());
  return out;
}

double tp_square_sum(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& parts,
                     const std::set<const void*>& replicated, int t) {
  std::vector<at::Tensor> split, whole;
  for (size_t i = 0; i < params.size(); ++i) {
    (replicated.count(params[i].unsafeGetTensorImpl()) ? whole : split).push_back(parts[i]);
  }
  return square_sum(split) + square_sum(whole) / t;
}

double TrainStrategy::gradient_square_sum() {
  std::vector<at::Tensor> grads;
  for (auto& p : parameters()) grads.push_back(p.grad());
  return square_sum(grads);
}

at::Tensor TrainStrategy::loss_weight_of(const at::Tensor& y) const { return loss_weight(y); }

double TrainStrategy::clip_gradients(double max_norm) {
  const double norm = std::sqrt(gradient_square_sum());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

const torch::optim::Optimizer* StrategyState::saved_optimizer(torch::optim::Optimizer& opt,
                                                              TrainingState&) {
  return &opt;
}

std::string StrategyState::save_sharded(const std::string&, const TrainingState&,
                                        const torch::optim::Optimizer&, int, AsyncCheckpointer*) {
  throw UsageError(
      "sharded checkpoints are written by the sharded strategies (zero1, zero2, "
      "fsdp) only");
}

TrainingState StrategyState::load_sharded(const std::string& dir, int64_t step,
                                          torch::optim::Optimizer&, int) {
  throw UsageError("the newest checkpoint in '" + dir + "' is sharded (step " +
                   std::to_string(step) +
                   "): resume it with a sharded strategy (zero1, zero2 or fsdp, at any world "
                   "size), or start afresh");
}

bool StrategyState::restore_optimizer(torch::optim::Optimizer&, const TrainingState& state) {
  return state.optimizer_restored;
}

}  // namespace scaletrain
