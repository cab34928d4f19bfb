#include "scaletrain/lr_schedule.h"

#include <cmath>

#include "scaletrain/error.h"

namespace scaletrain {

CosineLR::CosineLR(torch::optim::Optimizer& optimizer, int64_t epochs)
    : torch::optim::LRScheduler(optimizer), base_(get_current_lrs()), epochs_(epochs) {
  if (epochs < 1) throw UsageError("CosineLR needs at least one epoch");
}

std::vector<double> CosineLR::get_lrs() {
  std::vector<double> out;
  const double f =
      0.5 * (1 + std::cos(M_PI * static_cast<double>(step_count_) / static_cast<double>(epochs_)));
  for (double b : base_) out.push_back(b * f);
  return out;
}

}  // namespace scaletrain
