#include "scaletrain/model.h"

#include "scaletrain/error.h"

namespace scaletrain {

torch::nn::Sequential as_sequential(const Model& model) {
  if (!model.blocks) throw UsageError("model '" + model.name + "' has no block form");
  return model.blocks();
}

void to_channels_last(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
  }
  for (auto& b : module.buffers()) {
    if (b.dim() == 4) b.set_data(b.contiguous(at::MemoryFormat::ChannelsLast));
  }
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace scaletrain
