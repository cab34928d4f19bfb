#pragma once
// Sharded data parallelism (ZeRO stages 1-3, FSDP-style parameter sharding) for any world size:
// every rank runs forward and backward on its own slice of the batch, as with DDP, but each rank
// keeps only 1/N of the model state that DDP replicates. Note [Units] in src/zero/units.cpp and
// Note [Unit life cycle] in src/zero/sharded_step.cpp; docs/zero.md has the algorithm, bytes on the
// wire and measurements.
//
//   auto dist = scaletrain::init_process_group();
//   torch::nn::Sequential chain = my_model_as_blocks();             // stage 3: a chain (blocks.h)
//   scaletrain::ShardOptions so;
//   so.stage = 3;
//   scaletrain::ShardedDataParallel zero(chain, dist, so);
//   torch::optim::Adam opt(zero.parameters(), 1e-3);                 // this rank's shards only
//   for (auto& [x, y] : my_slice_of_the_data) {
//     opt.zero_grad();
//     torch::nn::functional::cross_entropy(zero(x), y).backward();  // reduce-scatters overlap it
//     zero.step(opt);                                                // update the shard, gather
//   }
//
// Stages (Ψ parameters, fp32, Adam's two moments; bytes per rank of parameters + gradients +
// optimizer state, as in Rajbhandari et al., "ZeRO", 2020):
//   DDP                     16Ψ
//   stage 1 (optimizer)      8Ψ + 8Ψ/N   gradients all there, reduce-scattered into the shard
//   stage 2 (+ gradients)    4Ψ + 12Ψ/N  a unit's full gradient lives only until its reduction
//   stage 3 (+ parameters)   16Ψ/N       + the units gathered at the moment (Note [Unit life
//   cycle])
//
// Contract. Construct it on every rank, in the same order as other collectives, after the
// module's parameters are final. The module must outlive it. Rank 0's parameters and buffers are
// broadcast at construction. Hand parameters() — one flat shard per unit, not the module's
// tensors — to the optimizer (any torch::optim optimizer; checkpoints know SGD, Adam and AdamW).
// After backward the averaged gradient is in those shards' .grad; the module's own .grad is not
// the averaged gradient (stage 1: averaged only in this rank's shard; stages 2 and 3: undefined).
// After the optimizer steps, the other ranks' shards are all-gathered: by step(opt), or by the
// next forward, which notices an updated shard by its version counter. Every backward must reach
// every parameter (unused parameters are an error naming them). One thread drives an instance.
// Stage 3: between forwards, the module's parameters of a resharded unit have no storage: read
// them only after gather_full_parameters(). With ShardOptions::param_dtype the module's
// parameters are compute copies in that dtype; the shards stay in the dtype they had.
//
// Stages 1 and 2 take any module and run its forward through forward(fn); stage 3 takes the model
// as a chain of blocks (torch::nn::Sequential of blocks.h's Block, or any Sequential), whose
// blocks it groups into units and gathers one unit at a time.

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/dist.h"

namespace scaletrain {

struct ShardOptions {
  int stage = 3;  // 1: optimizer state, 2: + gradients, 3: + parameters (FSDP)
  /// Units: runs of consecutive parameters (stages 1 and 2) or of consecutive blocks (stage 3)
  /// of up to this many MB each (FSDP's wrapping by size); a block larger than this is a unit of
  /// its own. Every collective moves one unit.
  double unit_cap_mb = 25;
  /// Stage 3: free a unit's gathered parameters after its forward (gathered again for its
  /// backward), as FSDP's reshard_after_forward; false keeps them until their backward is done.
  bool reshard_after_forward = true;
  /// Stage 3: start gathering the next unit while the current one computes (forward and
  /// backward), on a process group of its own.
  bool prefetch = true;
  /// Mixed precision (FSDP's MixedPrecisionPolicy), Note [Mixed precision] in
  /// src/zero/sharded_step.cpp. param_dtype: the dtype the module's parameters compute in (e.g.
  /// at::kBFloat16): gathers move it, forward and backward run in it, gradients arrive in it. The
  /// shards — the optimizer's master weights, its state and the shards' .grad — keep the dtype the
  /// parameters had at construction. The chain's forward(x) casts a floating-point input to it;
  /// callers of forward(fn) cast their own. gather_full_parameters() gives the module the master
  /// values.
  std::optional<at::ScalarType> param_dtype;
  /// The dtype gradients are reduced in (mixed precision's reduce dtype): e.g. at::kBFloat16
  /// halves the bytes on the wire; unset: the gradients' own dtype (param_dtype when given). The
  /// shard's gradient is back in the master dtype.
  std::optional<at::ScalarType> reduce_dtype;
  /// With param_dtype: floating-point buffers (BatchNorm's running statistics) are cast to this
  /// dtype at construction; LibTorch's batch norm wants them in its parameters' dtype. (Frozen
  /// parameters, which are not sharded, are cast to param_dtype.) UsageError without a
  /// param_dtype.
  std::optional<at::ScalarType> buffer_dtype;
  /// Ranks on one machine reduce and gather float32 CPU units through a shared-memory segment
  /// (Note [Shared-memory reduce] in src/transport/shm.cpp), as DDP does; else the backend.
  bool shared_memory = true;
  /// > 0: a unit whose gathered parameters (in param_dtype) exceed this many MB is refused at
  /// construction with an error naming it (split its block, or lower unit_cap_mb). A gather
  /// through shared memory with param_dtype also holds the unit in the master dtype meanwhile.
  double unit_memory_budget_mb = 0;
  /// Parameters the units leave out (FSDP's ignored_params): not sharded, broadcast, gathered or
  /// reduced, whole on this rank as the module holds them. The program reduces their gradients
  /// and gives them to its optimizer beside parameters() (expert parallelism's experts, which
  /// differ by rank). Not with param_dtype (UsageError): they would not compute in it.
  std::vector<at::Tensor> ignored_parameters;
};

/// A unit of the plan: `count` consecutive groups (parameters or blocks) from `first`, with
/// `numel` elements, padded to `padded` (a multiple of the world size; the shard is padded/N).
struct UnitRange {
  size_t first = 0, count = 0;
  int64_t numel = 0, padded = 0;
};

/// Note [Units]: groups consecutive `group_numels` into units of at most `cap_numel` elements
/// (a group larger than the cap is a unit of its own; groups of 0 elements join the unit they
/// stand in), each padded to a multiple of `world`. Pure; throws UsageError for world < 1.
std::vector<UnitRange> plan_units(const std::vector<int64_t>& group_numels, int64_t cap_numel,
                                  int world);

/// Bytes this rank holds for the model's state, counted from the live storages (each once).
struct ShardMemory {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t total() const { return parameters + gradients + optimizer; }
};

/// The same for any module (DDP's side of a comparison): its parameters and their gradients, and
/// `opt`'s state (SGD, Adam, AdamW) for the optimizer's parameters.
ShardMemory model_state_memory(const torch::nn::Module& module,
                               const torch::optim::Optimizer* opt = nullptr);

class ShardedDataParallel {
 public:
  /// Stages 1 and 2: any module (stage 3: a Sequential, else UsageError naming the fix). Throws
  /// Error when ranks' models differ (naming the first parameter), UsageError for a stage other
  /// than 1-3 and for a unit over unit_memory_budget_mb (naming it).
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, Dist dist,
                      ShardOptions options = {});
  ShardedDataParallel(torch::nn::Sequential chain, Dist dist, ShardOptions options = {});
  template <typename Impl>
  ShardedDataParallel(torch::nn::ModuleHolder<Impl> module, Dist dist, ShardOptions options = {})
      : ShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()),
                            std::move(dist), options) {}
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  /// The chain's forward on `input` (a model given as a Sequential), unit by unit.
  at::Tensor forward(const at::Tensor& input);
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }
  /// Stages 1 and 2: runs `fn`, which calls the module, after gathering updated shards.
  at::Tensor forward(const std::function<at::Tensor()>& fn);

  /// This rank's shard of each unit: the tensors to give the optimizer.
  const std::vector<at::Tensor>& parameters() const { return shards_; }
  /// opt.step() over parameters(), then every rank's updated shards gathered into the module
  /// (stages 1 and 2; stage 3 frees what is gathered, and gathers at the next forward). Throws
  /// Error naming the parameters that got no gradient in the last backward.
  void step(torch::optim::Optimizer& opt);
  /// Collective: the module holds every current parameter (stage 3: until the next forward or
  /// reshard()); e.g. for save_weights() on rank 0 or an evaluation outside forward(). With
  /// param_dtype, they are the master values in the master dtype (FSDP's summon_full_params),
  /// until the next forward, step() or reshard() brings back the compute copies; the whole
  /// model is then in the master dtype at once. Call it between steps, never between a forward
  /// and its backward (with param_dtype, the pending graph would see other parameters).
  void gather_full_parameters();
  /// Stage 3: frees the gathered units again; with param_dtype, every stage: the module's
  /// parameters are the compute copies again (stages 1, 2: refreshed from the shards by the
  /// next forward).
  void reshard();
  /// After the module's parameters were changed while gathered (gather_full_parameters(), then
  /// load_weights() or load_checkpoint() into the module): this rank's shards take their values
  /// from them (with param_dtype: losslessly, from the master values). Every rank must have
  /// loaded the same values. Not collective.
  void scatter_full_parameters();

  const std::vector<UnitRange>& units() const { return plan_; }
  /// The module's parameters this object shards, in its order, by the names its checkpoints
  /// keep them under (a chain's: "<block>.<name in the block>").
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  /// Each unit's parameters' indices in module.parameters() order.
  std::vector<std::vector<size_t>> unit_parameters() const;
  ShardMemory memory(const torch::optim::Optimizer* opt = nullptr) const;
  torch::nn::Module& module() { return *module_; }
  const Dist& dist() const { return dist_; }
  const ShardOptions& options() const { return options_; }

  /// Collective: writes this rank's shard of the parameters and of the optimizer's state (SGD,
  /// Adam, AdamW) with `state` to `dir/world-<N>/rank-<r>/ckpt-<step>.st` (N: the world size)
  /// (atomic, CRC; keeps the newest `keep` of the run's). Returns this rank's path. Every rank's
  /// file is on disk when it returns; with a `writer`, each rank's is written in the background
  /// instead (AsyncCheckpointer: on disk when its wait() or next save() returns, and a step whose
  /// files are not all there is not a complete checkpoint to load).
  std::string save(const std::string& dir, const TrainingState& state,
                   const torch::optim::Optimizer& opt, int keep,
                   AsyncCheckpointer* writer = nullptr) const;
  /// Collective: loads the sharded checkpoint of `global_step` in `dir`, saved at any world size
  /// (resharding: every rank reads every saved shard and takes its own slice), into the shards
  /// and `opt`. Throws Error naming the file for a missing or damaged shard, UsageError for
  /// another model (naming the first differing parameter) or, when `reshard` is false, another
  /// world size (naming both).
  TrainingState load(const std::string& dir, int64_t global_step, torch::optim::Optimizer& opt,
                     bool reshard = true);

  /// Collective: the optimizer's state over the whole model, each kind ("exp_avg",
  /// "momentum_buffer"...) flat in parameter order without padding, and "step" (Adam's count) as
  /// a 0-d tensor, on every rank: what a one-file checkpoint keeps (it loads at any world size
  /// and stage). Empty before the first step.
  std::map<std::string, at::Tensor> full_optimizer_state(const torch::optim::Optimizer& opt) const;
  /// Makes this rank's shards' state in `opt` the slices of full_optimizer_state()'s result.
  /// Throws UsageError when a kind's length is not the model's parameter count.
  void load_full_optimizer_state(torch::optim::Optimizer& opt,
                                 const std::map<std::string, at::Tensor>& state);

  struct Impl;  // src/zero/impl.h

 private:
  std::shared_ptr<torch::nn::Module> module_;
  Dist dist_;
  ShardOptions options_;
  std::vector<UnitRange> plan_;
  std::vector<at::Tensor> shards_;
  std::unique_ptr<Impl> impl_;
};

/// A sharded checkpoint read whole: every parameter at its full shape, by name, and each kind of
/// optimizer state ("exp_avg", "momentum_buffer"...) the same way. For a caller that loads it
/// into parameters of other shapes than the saved ones (tensor parallelism at another degree:
/// src/train/zero_strategy.cpp) or outside any ShardedDataParallel.
struct WholeShardedCheckpoint {
  TrainingState state;  // the program's state, as ShardedDataParallel::load() gives it
  std::map<std::string, at::Tensor> params;  // by name, in the masters' dtype, on the CPU
  std::string optimizer;                     // "sgd", "adam" or "adamw"
  int64_t optimizer_step = 0;                // Adam's count (0 before the first step)
  std::map<std::string, std::map<std::string, at::Tensor>> optimizer_state;  // kind -> name
};
/// Not collective: reads every rank's file of the largest world that saved `global_step` in
/// `dir` (CRC and run checked as load() checks them). Throws Error naming the folder when no
/// world saved it whole, or the file that is damaged or of another run.
WholeShardedCheckpoint read_sharded_checkpoint(const std::string& dir, int64_t global_step);

/// The newest step in `dir` with a valid shard for every rank of the world it was saved at;
/// nullopt when there is none.
std::optional<int64_t> newest_sharded_checkpoint(const std::string& dir);
/// The steps of the sharded checkpoints in `dir` (rank 0's files, of any world), newest first,
/// complete or not; reads only names.
std::vector<int64_t> sharded_checkpoint_steps(const std::string& dir);
/// Whether `dir` holds every rank's file of `step` for a world that saved it, each sound (its
/// CRC) and of one run. Damaged files are reported (logged) as skipped.
bool sharded_checkpoint_complete(const std::string& dir, int64_t step);

}  // namespace scaletrain
