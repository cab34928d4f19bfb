#pragma once
// Models defined in Python, trained from C++ (docs/python_models.md).
//
// A module saved by Python's torch.jit.save(torch.jit.script(m)) or torch.jit.save(
// torch.jit.trace(m, x)) becomes the library's Model (model.h), which the trainer takes like a
// module written in C++: every strategy that needs no split of its layers (ddp, dp, zero1,
// zero2, fsdp; the pipelines and the grid when the module is an nn.Sequential of blocks),
// clipping, AMP, checkpoints and exact resume. Its parameters keep the module's own names
// ("features.0.weight"), so Python loads the trained weights with
// module.load_state_dict(torch.load("model.pt")).
//
//   scaletrain::TrainTask task;
//   task.model = [] { return scaletrain::load_python_model("net.pt"); };
//
// TorchScript is deprecated upstream in favour of torch.export, but it is the one form of a
// Python model that LibTorch 2.11 can run backward through in C++. The loader is this one
// function: a loader of exported programs can take its place without changing its callers.
//
// Contract: the module's forward takes one tensor (the batch) and returns one tensor (the
// outputs the task's loss reads); it has at least one trainable parameter. A traced module
// keeps the control flow of the one input it was traced with (and the training mode it was
// traced in: trace it in the mode it trains in); a scripted one keeps all of it. Tensors the
// module holds other than its parameters and buffers (constants) stay where they were saved.

#include <string>

#include "scaletrain/model.h"

namespace torch::jit {
struct Module;
}

namespace scaletrain {

/// Loads the Python model saved at `path` (TorchScript's archive) on the CPU, named after the
/// file. Throws UsageError naming the file for a file that is missing or not such an archive, a
/// forward that does not take one tensor, or a module with no trainable parameter.
Model load_python_model(const std::string& path);

/// The same from a TorchScript module the program holds (torch::jit::load's), named `name`. The
/// Model shares the module's parameter tensors: training one trains the other.
Model script_model(const torch::jit::Module& module, const std::string& name);

/// Whether `path` names a file that load_python_model() would take (a zip archive, by its first
/// bytes), for a command line that takes either a model's name or a file.
bool is_python_model_file(const std::string& path);

}  // namespace scaletrain
