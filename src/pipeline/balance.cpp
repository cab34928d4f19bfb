#include "scaletrain/balance.h"

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <sstream>

#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {

PipelineOptions place_by_memory(const torch::nn::Sequential& model,
                                const std::vector<DeviceBudget>& budgets, std::string* report) {
  std::vector<int64_t> bytes, counts;
  for (const auto& layer : model->children()) {
    int64_t b = 0, n = 0;
    for (const auto& t : layer->parameters()) b += static_cast<int64_t>(t.nbytes()), n += t.numel();
    for (const auto& t : layer->buffers()) b += static_cast<int64_t>(t.nbytes());
    bytes.push_back(b);
    counts.push_back(n);
  }
  const Placement placed = place_layers(bytes, budgets);
  PipelineOptions o;
  o.balance = placed.balance;
  for (const auto& d : placed.devices) o.devices.emplace_back(d);
  if (report != nullptr) {
    std::istringstream lines(placed.report());
    std::string line;
    size_t layer = 0;
    report->clear();
    for (size_t s = 0; std::getline(lines, line); ++s) {
      int64_t params = 0;
      for (int i = 0; i < placed.balance[s]; ++i) params += counts[layer++];
      *report += line + ", " + std::to_string(params) + " parameters\n";
    }
  }
  return o;
}

std::vector<LayerProfile> profile_layers(const torch::nn::Sequential& model,
                                         const at::Tensor& sample, int repeats) {
  if (repeats < 1) throw UsageError("profile_layers needs at least one repeat");
  using Clock = std::chrono::steady_clock;
  std::vector<LayerProfile> out(model->size());
  size_t k = 0;
  for (const auto& layer : model->children()) {
    for (const auto& t : layer->parameters())
      out[k].parameter_bytes += static_cast<int64_t>(t.nbytes());
    for (const auto& t : layer->buffers())
      out[k].parameter_bytes += static_cast<int64_t>(t.nbytes());
    ++k;
  }
  std::vector<torch::nn::AnyModule> layers(model->begin(), model->end());
  for (int r = 0; r <= repeats; ++r) {  // the first pass warms up and is not counted
    at::Tensor h = sample;
    for (size_t i = 0; i < layers.size(); ++i) {
      // Each layer on its own graph: its backward is timed alone.
      at::Tensor in = h.detach().requires_grad_(h.is_floating_point());
      auto t0 = Clock::now();
      at::Tensor y = layers[i].forward(in);
      double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      if (y.requires_grad()) {
        auto grad = at::ones_like(y);
        t0 = Clock::now();
        y.backward(grad);
        secs += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      if (r > 0) {
        // The fastest repeat: an interruption by another process only ever adds time.
        out[i].seconds = r == 1 ? secs : std::min(out[i].seconds, secs);
        out[i].activation_bytes = static_cast<int64_t>(y.nbytes());
      }
      h = y.detach();
    }
  }
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();  // leave no trace
  return out;
}

std::vector<int> balance_by_time(const torch::nn::Sequential& model, const at::Tensor& sample,
                                 int stages, int repeats) {
  std::vector<double> costs;
  for (const auto& p : profile_layers(model, sample, repeats)) costs.push_back(p.seconds);
  return balance_by_cost(costs, stages);
}

std::vector<int> balance_by_size(const torch::nn::Sequential& model, int stages) {
  std::vector<double> costs;
  for (const auto& layer : model->children()) {
    double b = 0;
    for (const auto& t : layer->parameters()) b += static_cast<double>(t.nbytes());
    costs.push_back(b);
  }
  return balance_by_cost(costs, stages);
}

}  // namespace scaletrain
