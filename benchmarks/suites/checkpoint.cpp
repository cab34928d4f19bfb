// Suite `checkpoint`: what a checkpoint costs the step loop. A model of about GPT-2 small's size
// (13 Linear(3072, 3072): 122.7M parameters against its 124M) with Adam's state after one step:
// save_checkpoint() blocks for all of it (serialise, checksum, write, fsync, rename);
// AsyncCheckpointer::save() blocks for the copy in memory only, and its background write takes the
// rest. Both layouts side by side: one file (--checkpoint-format full) and a folder in PyTorch's
// DCP layout (dcp, the trainer's default).

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <filesystem>

#include "scaletrain/checkpoint.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

TrainingState state_of(int64_t step) {
  TrainingState s;
  s.run_id = "bench";
  s.model_name = "linear-stack";
  s.global_step = step;
  return s;
}

}  // namespace

SuiteResult run_checkpoint(const SuiteOptions& o) {
  const std::string title =
      "What a checkpoint costs the step loop: synchronous vs background, one file vs DCP folder";
  SuiteResult r = new_result("checkpoint", title, "s",
                             {Plot::Kind::kBars, title, "", "seconds", false, false}, o);
  const int layers = o.quick ? 2 : 13;
  const int64_t width = o.quick ? 1024 : 3072;
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(width, width));
  torch::optim::Adam opt(model->parameters());
  model->forward(torch::randn({4, width})).pow(2).mean().backward();
  opt.step();  // Adam's state exists: the file holds 3 copies of the parameters' size
  int64_t params = 0;
  for (auto& p : model->parameters()) params += p.numel();
  r.notes.push_back("Model: " + std::to_string(layers) + " Linear(" + std::to_string(width) + ", " +
                    std::to_string(width) + "), " + std::to_string(params) +
                    " parameters, with Adam's state (about " +
                    std::to_string(params * 12 / (1 << 20)) + " MiB per checkpoint).");
  const std::string dir = o.work_dir + "/checkpoint";
  r.notes.push_back("Written to " + dir + " (the work folder's file system), keeping 1.");

  for (const auto layout : {CheckpointLayout::kFile, CheckpointLayout::kDcp}) {
    const bool dcp = layout == CheckpointLayout::kDcp;
    const std::string in = dcp ? ", DCP folder" : ", one file";
    const double x = dcp ? 3 : 0;
    Sample sync{"cpu", "synchronous save" + in, x, {}};
    Sample blocked{"cpu", "background: the step waits" + in, x + 1, {}};
    Sample write{"cpu", "background: the write" + in, x + 2, {}};
    AsyncCheckpointOptions ao;
    ao.layout = layout;
    AsyncCheckpointer writer(ao);
    for (int rep = 0; rep < o.repeats; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      save_checkpoint(dir, state_of(2 * rep), *model, &opt, 1, layout);
      sync.values.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      writer.save(dir, state_of(2 * rep + 1), *model, &opt, 1);
      blocked.values.push_back(seconds_since(t0));
      writer.wait();
      write.values.push_back(writer.timing().write);
    }
    std::filesystem::remove_all(dir);
    for (auto* sample : {&sync, &blocked, &write}) r.samples.push_back(*sample);
  }
  r.notes.push_back(
      "The background write runs beside the training, which on a machine with few cores slows "
      "the steps while it lasts; the step's own wait is the copy of parameters and optimizer "
      "state into memory.");
  return r;
}

}  // namespace scaletrain::bench
