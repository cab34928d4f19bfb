#pragma once
// ParallelDims: a job's parallel degrees as one value, and the only place that knows how they
// make up the world. The world's ranks are
//
//     world = dp · pp · cp · tp,   dp = dp_replicate · dp_shard
//
// laid out on the DeviceMesh {dp, cp, pp, tp} (mesh.h), outermost first, so that the ranks of
// one tensor-parallel group are neighbours (rank = ((dp · cp + cp) · pp + pp) · tp + tp, in
// coordinates), and dp and cp are next to each other: dp x cp flattened, the ranks that average a
// gradient, is one dimension of a mesh {dp · cp, pp, tp} with the same ranks in the same places:
//
//   dp_replicate  data-parallel replicas that each hold whole parameters and optimizer state
//                 (DDP; a grid's replicas of its pipeline)
//   dp_shard      data-parallel ranks that share out the optimizer state, then the gradients,
//                 then the parameters (ZeRO stage 1, 2, 3 = fsdp; zero_stage says which)
//   pp            pipeline stages, one rank each
//   cp            context parallelism: ranks that each hold a slice of every sequence
//                 (context_parallel.h); they hold the same weights, and their gradients are
//                 averaged with the data-parallel ones (over dp · cp ranks, TorchTitan's rule)
//   tp            the tensor-parallel degree: ranks that split each layer
//   ep            expert parallelism: consecutive blocks of ep ranks of dp x cp (flattened) each
//                 spread every MoE layer's experts over them, E / ep per rank; the other
//                 weights are as dp and cp have them. It borrows its ranks from dp x cp and adds
//                 none to the world; the ranks holding the same experts (dp x cp / ep of them,
//                 "edp") average those experts' gradients
//
// dp_replicate and dp_shard share the mesh's one "dp" dimension: a strategy today either
// replicates or shards over all of it (a hybrid of both would make it two dimensions). The
// global batch splits over dp() ranks; one copy of the model spans pp · tp ranks, and each
// sequence cp ranks.
//
// A degree of -1 means "the rest of the world" (resolve() fills it in), as TorchTitan's
// data_parallel_shard_degree -1 does. TrainerOptions' strategy words are shorthand for a value
// of this (parallel_dims() in trainer_options.h): ddp {dp_replicate -1, tp}, zero1/zero2/fsdp
// {dp_shard -1, zero_stage 1/2/3, tp}, grid {dp_replicate -1, pp, tp}, each with its cp; dp and
// pipeline run in
// one process (all degrees 1: their devices are threads of that process).
//
// Adding a dimension (docs/parallelism.md's recipe): one field here, in world(), describe(),
// resolve()'s checks and mesh()'s order, and the tables of tests/parallel_dims_test.cpp.
//
// A plain value: no process group, no LibTorch.

#include <string>
#include <vector>

#include "scaletrain/mesh.h"

namespace scaletrain {

struct ParallelDims {
  int dp_replicate = 1;  ///< data-parallel replicas holding whole state; -1: the rest
  int dp_shard = 1;      ///< data-parallel ranks sharding state (ZeRO); -1: the rest
  int zero_stage = 0;    ///< what dp_shard shards: 0 none (dp_shard 1), 1, 2, or 3 (fsdp)
  int pp = 1;            ///< pipeline stages, one rank each; -1: the rest
  int tp = 1;            ///< tensor-parallel degree; -1: the rest
  int cp = 1;            ///< context-parallel degree: ranks per sequence; -1: the rest
                         ///< (last, so that {dp_replicate, dp_shard, zero_stage, pp, tp}
                         ///< reads as before; the mesh puts it after dp)
  int ep = 1;            ///< expert-parallel degree: each MoE layer's experts spread over ep of
                         ///< the dp x cp ranks (expert_parallel.h); not a factor of the world:
                         ///< dp x cp = edp x ep, TorchTitan's rule

  /// dp_replicate · dp_shard: the data-parallel ranks the global batch splits over.
  int dp() const { return dp_replicate * dp_shard; }
  /// pp · tp: the ranks that hold one copy of the model.
  int model_ranks() const { return pp * tp; }
  /// dp() · cp: the ranks a gradient is averaged over.
  int dp_cp() const { return dp() * cp; }
  /// dp() · pp · cp · tp: the ranks of the world these degrees make (after resolve()).
  int world() const { return dp() * model_ranks() * cp; }

  /// These degrees with the one that is -1 (if any) filled in from `world`. Throws UsageError
  /// naming the degrees, the world and the fix when a degree is 0 or below -1, two are -1, the
  /// others do not divide `world`, their product is not `world`, zero_stage is not 0-3, or
  /// zero_stage and dp_shard disagree (a shard without a stage, or a stage without a shard
  /// degree to say so: dp_shard 1 with a stage is a world of one data-parallel rank, allowed),
  /// or ep is below 1 or does not divide dp x cp.
  ParallelDims resolve(int world) const;

  /// The mesh of the named dimensions ("dp", "cp", "pp", "tp"), in that order whatever the order of
  /// `names`; every dimension left out must have degree 1. Throws UsageError for an unknown
  /// name, a left-out dimension of degree above 1, or unresolved degrees (-1).
  /// The default is the mesh without cp (cp 1), as every strategy but context parallelism's
  /// lays it out.
  DeviceMesh mesh(const std::vector<std::string>& names = {"dp", "pp", "tp"}) const;

  /// "dp 4 (zero1) x cp 2 x pp 2 x tp 2", with " (ep 2)" after where ep > 1; degrees of 1 are left
  /// out ("dp 1" when all are 1; a -1 reads "rest").
  std::string describe() const;

  bool operator==(const ParallelDims& o) const {
    return dp_replicate == o.dp_replicate && dp_shard == o.dp_shard && zero_stage == o.zero_stage &&
           pp == o.pp && cp == o.cp && tp == o.tp && ep == o.ep;
  }
  bool operator!=(const ParallelDims& o) const { return !(*this == o); }
};

}  // namespace scaletrain
