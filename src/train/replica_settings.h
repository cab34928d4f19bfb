#pragma once
// What every fault-tolerant replica of a job must share (internal; Note [Replica settings] in
// replica_settings.cpp).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

#include "scaletrain/trainer_options.h"

namespace scaletrain {

/// "name=value|name=value...": the settings that change a step's arithmetic or the samples it
/// trains (seed, batch, data, epochs, learning rate, the optimizer and each of its options, the
/// strategy and the mesh, clipping, mixed precision, accumulation, the model's name and
/// structure with its modules' options, dropout among them). Replicas that differ in one are
/// refused by the lighthouse, naming it.
std::string replica_settings(const TrainerOptions& o, const std::string& model_name,
                             const torch::nn::Module& module,
                             const torch::optim::Optimizer& optimizer, int64_t samples);

}  // namespace scaletrain
