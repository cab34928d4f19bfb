// The evaluation of the test set after each epoch (Run::evaluate): every sample once over the
// data-parallel replicas, in batches of TrainerOptions::eval_batch_size (the training batch per
// replica by default), each metric's weighted sum all-reduced.

#include <algorithm>

#include "scaletrain/error.h"
#include "scaletrain/sampler.h"
#include "train/run.h"

namespace scaletrain {

std::map<std::string, double> Run::evaluate() {
  std::map<std::string, double> out;
  if (task_.test_data.size < 1 || task_.metrics.empty()) return out;
  torch::NoGradGuard no_grad;
  strategy_->train_mode(false);
  DistributedSampler s(
      {task_.test_data.size, strategy_->data_replicas(), strategy_->data_rank(), false, 0, false});
  const int64_t batch = o_.eval_batch_size > 0 ? o_.eval_batch_size : per_replica_;
  auto next = batch_stream(task_.test_data, test_rows_, s.indices(), loader_options(batch, 0, 0));
  const auto k = static_cast<int64_t>(task_.metrics.size());
  // Each metric's weighted sum and its weight, and last whether this rank refused its data.
  auto sums = at::zeros({2 * k + 1}, at::kDouble);
  // A metric's refusal of this rank's test data (a target outside the classes): the rank goes on
  // through the batches' collectives without scoring, and every rank throws after the sum, so
  // that the other replicas never wait for it (regression
  // SplitPathScoredOutOfVocabularyTargetsSilently).
  std::string refused;
  int64_t position = 0;
  const at::Device dev = strategy_->device();
  const bool all_split = std::all_of(task_.metrics.begin(), task_.metrics.end(),
                                     [](const Metric& m) { return bool(m.per_sample_split); });
  while (auto b = next()) {
    auto x = b->inputs.to(dev, true);
    if (o_.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    // A class-split output is scored where it lies when every metric can (no rank gathers it).
    auto split = all_split ? strategy_->predict_split(x) : std::nullopt;
    const at::Tensor outputs = split ? split->slice : strategy_->predict(x);
    const int64_t rows = b->targets.size(0);
    if (outputs.defined()) {
      auto keep = at::empty({rows}, at::kDouble);  // padded duplicates count once
      for (int64_t i = 0; i < rows; ++i) keep[i] = s.is_padding(position + i) ? 0.0 : 1.0;
      const auto y = b->targets.to(outputs.device());
      for (int64_t m = 0; m < k && refused.empty(); ++m) {
        const auto& metric = task_.metrics[static_cast<size_t>(m)];
        try {
          auto w =
              metric.weight ? metric.weight(outputs, y).to(at::kCPU, at::kDouble) * keep : keep;
          auto v = split ? metric.per_sample_split(outputs, y, split->where)
                         : metric.per_sample(outputs, y);
          sums[2 * m] += (v.to(at::kCPU, at::kDouble) * w).sum();
          sums[2 * m + 1] += w.sum();
        } catch (const UsageError& e) {
          refused = e.what();
          sums[2 * k] = 1;
        }
      }
    }
    position += rows;
  }
  strategy_->train_mode(true);
  auto summed = sums.to(collective_device());
  d_.all_reduce(summed);
  summed = summed.cpu();
  if (summed[2 * k].item<double>() > 0) {
    throw UsageError(!refused.empty() ? refused
                                      : "rank " + std::to_string(d_.rank()) +
                                            ": another rank's test data was refused by a metric "
                                            "(its error says why)");
  }
  for (int64_t m = 0; m < k; ++m) {
    const auto& metric = task_.metrics[static_cast<size_t>(m)];
    const double mean = summed[2 * m].item<double>() / summed[2 * m + 1].item<double>();
    out[metric.name] = metric.finish ? metric.finish(mean) : mean;
  }
  return out;
}

}  // namespace scaletrain
