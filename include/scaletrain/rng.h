#pragma once
// Random streams per rank, and their place in checkpoints (Note [Rank streams] in
// src/train/rng.cpp). Dropout and other random layers draw from the process's default
// generators (the CPU's and each GPU's). Two rules make them right under data parallelism and
// across a resume:
//
//   1. Each rank draws its own stream: seed rank r with rank_seed(seed, r) after the model is
//      built (the weights come from rank 0 anyway), so ranks do not draw the same dropout masks.
//      Except within a tensor-parallel group, whose ranks must draw the same masks (a split
//      model's dropout, Note [Coordinated dropout] in zoo/gpt.cpp): they share one stream,
//      e.g. rank_seed(seed, rank / tp) where groups are consecutive ranks (the trainer's).
//   2. A checkpoint holds every rank's generators, not rank 0's alone: only rank 0 writes the
//      file, so the states travel to it first (gather_rng_states(), collective), and each rank
//      takes its own back on resume (restore_rng_states()).
//
// In a loop of one's own:
//
//   torch::manual_seed(seed);  auto model = build();        // the same start on every rank
//   torch::manual_seed(scaletrain::rank_seed(seed, dist.rank()));
//   ...
//   auto rng = scaletrain::gather_rng_states(dist);          // on every rank, at a checkpoint
//   state.tensors.insert(rng.begin(), rng.end());
//   if (dist.rank() == 0) scaletrain::save_checkpoint(dir, state, *model, opt, 3);
//   ...
//   auto state = scaletrain::load_checkpoint(path, *model, opt, "net");   // every rank reads
//   if (!scaletrain::restore_rng_states(state.tensors, dist))             // another world size
//     torch::manual_seed(scaletrain::rank_seed(seed + state.global_step, dist.rank()));
//
// Threads that share a process (DataParallel replicas, a pipeline's stage threads on the CPU)
// share its CPU generator and draw from it in the order they run: dropout there is random but
// not reproducible, on CPU devices.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>

#include "scaletrain/dist.h"

namespace scaletrain {

/// The seed of rank `rank`'s stream: `seed` itself for rank 0 (a run of one process draws what
/// torch::manual_seed(seed) gives), a mix of both for the others (distinct for every rank).
uint64_t rank_seed(uint64_t seed, int rank);

/// Collective: every rank's generator states as named tensors, on every rank —
/// "rng/rank<r>/cpu" and "rng/rank<r>/cuda:<i>" for each rank r and each GPU it sees, and
/// "rng/world" (the world size they were taken at). `via`: the device the collective runs on
/// (this rank's GPU under NCCL, the CPU under Gloo).
std::map<std::string, at::Tensor> gather_rng_states(const Dist& dist,
                                                    at::Device via = at::Device(at::kCPU));

/// Puts this rank's generators back from gather_rng_states()'s tensors (others in the map are
/// ignored). Returns false, changing nothing, when they were taken at another world size or hold
/// no state for this rank: the caller then seeds a fresh stream. Not collective.
bool restore_rng_states(const std::map<std::string, at::Tensor>& tensors, const Dist& dist);

}  // namespace scaletrain
