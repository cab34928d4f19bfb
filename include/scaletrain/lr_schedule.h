#pragma once
// Learning-rate schedules beside LibTorch's own (torch::optim::StepLR, ReduceLROnPlateau), for
// TrainTask::scheduler (trainer.h): stepped once per epoch.

#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <vector>

namespace scaletrain {

/// Cosine annealing over `epochs` steps: lr = base · (1 + cos(π · step / epochs)) / 2, from each
/// parameter group's learning rate at construction (PyTorch's CosineAnnealingLR, eta_min 0).
class CosineLR : public torch::optim::LRScheduler {
 public:
  CosineLR(torch::optim::Optimizer& optimizer, int64_t epochs);

 private:
  std::vector<double> get_lrs() override;
  std::vector<double> base_;
  int64_t epochs_;
};

}  // namespace scaletrain
