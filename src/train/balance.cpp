#include "train/balance.h"

#include <ATen/ops/tensor.h>

#include <numeric>
#include <sstream>

#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {

// Regression (FsdpWithoutBlocksWasCalledAPipelineStrategy): fsdp, which needs the chain for its
// units, said "the pipeline strategies" and offered ddp or dp only.
torch::nn::Sequential chain_of(const Model& model, Strategy strategy) {
  if (model.blocks) return model.blocks();
  const std::string give =
      "' has none: give Model::blocks (model_of(module, name, blocks) in trainer.h; "
      "scaletrain::Block in blocks.h), or train with ";
  if (strategy == Strategy::kFsdp) {
    throw UsageError(
        "TrainerOptions::strategy fsdp shards the model in units, one per block of "
        "its chain (each gathered for its forward and backward), and model '" +
        model.name + give +
        "zero1 or zero2 (which shard the optimizer state and gradients of any "
        "model) or ddp");
  }
  throw UsageError("TrainerOptions::strategy " + to_string(strategy) +
                   " splits the model into pipeline stages along its chain of blocks, and "
                   "model '" +
                   model.name + give + "ddp or dp");
}

std::vector<int> parse_balance_list(const std::string& spec) {
  std::vector<int> out;
  std::stringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      out.push_back(std::stoi(item, &used));
      if (used != item.size() || out.back() < 1) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw UsageError("TrainerOptions::pipeline.balance '" + spec + "': '" + item +
                       "' is not a positive number of blocks; give auto, time, size or N,M,...");
    }
  }
  return out;
}

std::vector<int> resolve_balance(const Balance& balance, const torch::nn::Sequential& chain,
                                 int stages, const at::Tensor& sample) {
  if (static_cast<int>(chain->size()) < stages) {
    throw UsageError("the model's chain has " + std::to_string(chain->size()) +
                     " blocks, fewer than the " + std::to_string(stages) +
                     " stages: give fewer devices (or TrainerOptions::pipeline.stages, or "
                     "TrainerOptions::pipeline.stages_per_device)");
  }
  if (balance.by == Balance::By::kTime) {
    return balance_by_time(chain, sample.narrow(0, 0, std::min<int64_t>(sample.size(0), 8)), stages,
                           2);
  }
  if (balance.by == Balance::By::kSize) return balance_by_size(chain, stages);
  const std::vector<int>& out = balance.layers;
  const int total = std::accumulate(out.begin(), out.end(), 0);
  if (static_cast<int>(out.size()) != stages || total != static_cast<int>(chain->size())) {
    throw UsageError("TrainerOptions::pipeline.balance '" + balance.str() + "' gives " +
                     std::to_string(out.size()) + " stages of " + std::to_string(total) +
                     " blocks; the pipeline has " + std::to_string(stages) +
                     " stages and the model's chain " + std::to_string(chain->size()) + " blocks");
  }
  return out;
}

std::vector<int> resolve_balance(const Balance& balance, const torch::nn::Sequential& chain,
                                 int stages, const at::Tensor& sample, const Dist& dist,
                                 const at::Device& device) {
  std::vector<int64_t> mine(static_cast<size_t>(stages), 0);
  std::string problem;
  if (dist.rank() == 0) {
    try {
      auto b = resolve_balance(balance, chain, stages, sample);
      mine.assign(b.begin(), b.end());
    } catch (const UsageError& e) {
      problem = e.what();
    }
  }
  auto t = at::tensor(mine, at::kLong).to(device);  // NCCL carries device tensors only
  dist.broadcast(t, 0);  // (a refusal on rank 0 shows as zeros: every rank refuses)
  t = t.cpu();
  std::vector<int> out(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + stages);
  if (out[0] == 0) {
    throw UsageError(problem.empty() ? "rank 0 could not balance the pipeline (see its error)"
                                     : problem);
  }
  return out;
}

}  // namespace scaletrain
