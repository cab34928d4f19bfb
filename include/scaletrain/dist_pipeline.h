#pragma once
// Pipeline parallelism across processes: one stage per rank, activations sent forward and
// gradients backward (through shared memory between CPU stages on one machine, else through
// the process group: Gloo on CPU, NCCL on CUDA), under the same
// schedules as the in-process Pipeline (schedule.h: GPipe, 1F1B, zero bubble H1, and
// interleaved 1F1B with several stages per rank; zero bubble H1 and interleaving not with
// `ddp`).
//
//   // ranks 0 and 1 hold the two halves of a model
//   auto seq = scaletrain::as_sequential(model);
//   DistPipelineOptions o;
//   o.stage_ranks = {0, 1};
//   o.chunks = 4;
//   DistPipeline pipe(rank == 0 ? slice(seq, 0, 8) : slice(seq, 8, 18), o, dist);
//   auto loss = pipe.train_step(x /* first stage */, y /* last stage */, cross_entropy);
//
// Interleaved 1F1B: cut the model into p·v stages; rank stage_ranks[r] holds stages r, r + p,
// ..., r + (v−1)p as its chunks 0..v−1, and the last rank's chunk c feeds the first rank's chunk
// c + 1:
//
//   o.schedule = PipelineSchedule::kInterleaved1F1B;   // p = 2, v = 2: stages 0..3
//   DistPipeline pipe({slice(seq, cut[r], cut[r + 1]), slice(seq, cut[r + 2], cut[r + 3])}, o,
//                     dist);
//
// Data x pipeline grids: give `ddp` a DistributedDataParallel wrapping this stage over the
// ranks that hold the same stage in the other pipeline replicas (new_group in dist.h). Each
// stage's micro-batch backwards then accumulate locally (no_sync) and the stage's last
// backward averages the accumulated gradients over the replicas.
//
// Every micro-batch is a tensor of the batch's dtype; a batch is cut into `chunks` micro-batches,
// or fewer when it has fewer samples (the first stage tells the others how many). A failure on one
// rank makes the others fail at the collective timeout with an error naming the transfer they
// waited for.

#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/pipeline.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

class DistributedDataParallel;
class PointToPoint;

struct DistPipelineOptions {
  std::vector<int> stage_ranks;  // the ranks of this pipeline's stages, first to last
  int chunks = 1;
  PipelineSchedule schedule = PipelineSchedule::kGPipe;
  at::Device device = at::kCPU;            // this stage's device
  DistributedDataParallel* ddp = nullptr;  // optional, wraps this stage (grids)
  /// Stages on one machine hand CPU activations and gradients through shared memory (a segment
  /// per pair of neighbouring ranks, set up at the first step); false: through the process
  /// group's backend. Stages on other machines, and device tensors, always use the backend.
  /// Every rank passes the same value.
  bool shared_memory = true;
  /// Activation checkpointing, as Pipeline's: a checkpointed micro-batch keeps only its input
  /// through forward and runs its forward again in backward. Every rank passes the same value.
  /// The recomputation does not replay random generators (dropout draws new masks) and updates
  /// a BatchNorm's running statistics again: use it with deterministic layers.
  PipelineCheckpoint checkpoint = PipelineCheckpoint::kNever;
};

class DistPipeline {
 public:
  /// `stage`: this rank's layers, moved to options.device. Throws UsageError when this rank is
  /// not in stage_ranks, chunks < 1, the schedule is interleaved 1F1B, or zero bubble H1 comes
  /// with `ddp`.
  DistPipeline(torch::nn::Sequential stage, DistPipelineOptions options, const Dist& dist);
  /// Interleaved 1F1B: this rank's chunks (its stages in model order, stage_ranks' position r
  /// holding the model's stages r, r + p, ...). Throws UsageError unless the schedule is
  /// kInterleaved1F1B with at least 2 chunks on at least 2 ranks, without `ddp`; one chunk is
  /// the constructor above.
  DistPipeline(std::vector<torch::nn::Sequential> chunks, DistPipelineOptions options,
               const Dist& dist);

  /// One training step. The first stage passes the batch's `input`, the last its `target`;
  /// other ranks pass undefined tensors. Gradients accumulate in this stage's parameters.
  /// Returns the batch loss on the last stage, an undefined tensor elsewhere.
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss);

  /// Forward only, micro-batched (no grad): the first stage passes the batch's `input`, the
  /// others an undefined tensor. Returns the batch's outputs on the last stage, undefined
  /// elsewhere. Every stage's rank calls it.
  at::Tensor forward(const at::Tensor& input);

  int stage() const { return stage_; }
  int num_stages() const { return static_cast<int>(options_.stage_ranks.size()); }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  /// Activation shape messages this rank sent in its training steps: one per activation on a
  /// step whose batch shape differs from the last step's, none otherwise (Note [Shapes once]).
  int64_t shape_messages() const { return shape_messages_; }
  /// How this rank's messages travel, once a step has run: "shared memory" (every neighbour
  /// through it), "gloo" or "nccl" (none), "mixed"; "" before the first step or on one stage.
  std::string transport() const;
  /// This rank's (first) chunk; chunk(c) for the others.
  torch::nn::Sequential& module() { return stage_module_; }
  torch::nn::Sequential& chunk(int c) { return chunks_.at(static_cast<size_t>(c)); }

 private:
  class Transfers;
  class Step;                       // one train_step's micro-batches and tasks
  int neighbour(int offset) const;  // the rank of stage + offset, or -1
  std::vector<at::Tensor> split(const at::Tensor& t, const char* what) const;
  struct Agreed {
    int count = 0;             // micro-batches of this step
    bool reuse = false;        // every stage reuses its shapes (Note [Shapes once])
    std::vector<int64_t> key;  // the batch's dtype, dims and sizes
  };
  Agreed agree_microbatches(const at::Tensor& input);
  Agreed relay_microbatches(const at::Tensor& input);
  std::vector<PipeTask> my_tasks(int microbatches) const;
  // A receive a step's tasks will make, known ahead (Note [Shapes once]).
  struct Expected {
    int from, tag;
    std::vector<int64_t> shape;  // dtype, then sizes
  };
  std::vector<Expected> expected_receives(const std::vector<PipeTask>& order) const;
  bool first_of_model(int chunk) const;
  bool last_of_model(int chunk) const;
  int previous_rank() const;
  int next_rank() const;
  int input_id(int microbatch, int chunk) const;
  int output_id(int microbatch, int chunk) const;
  std::string which(int microbatch, int chunk) const;
  PointToPoint& p2p();  // made at the first step (collective with the neighbours)

  // Note [Shapes once] in dist_pipeline.cpp: per message id, dtype then sizes.
  using Shapes = std::map<int, std::vector<int64_t>>;
  Shapes sent_shapes_, received_shapes_;
  int64_t shaped_count_ = -1;
  std::vector<int64_t> shaped_key_;
  bool shapes_valid_ = false;
  int64_t shape_messages_ = 0;

  std::vector<torch::nn::Sequential> chunks_;
  torch::nn::Sequential stage_module_{nullptr};
  DistPipelineOptions options_;
  Dist dist_;
  std::shared_ptr<PointToPoint> p2p_;
  int stage_ = 0;
};

/// Layers [begin, end) of a Sequential, as a Sequential sharing them.
torch::nn::Sequential slice(const torch::nn::Sequential& model, size_t begin, size_t end);

}  // namespace scaletrain
