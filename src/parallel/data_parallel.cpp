#include "scaletrain/data_parallel.h"

#include <ATen/Parallel.h>

#include <exception>
#include <thread>

#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {
namespace {

// Runs fn(k) for every replica on its own thread; the first failure is raised here.
void on_each(size_t n, const std::vector<at::Device>& devices,
             const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      at::init_num_threads();  // a new thread: take the process's intra-op thread count
      try {
        fn(k);
      } catch (...) {
        errors[k] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < n; ++k) {
    if (!errors[k]) continue;
    try {
      std::rethrow_exception(errors[k]);
    } catch (const std::exception& e) {
      throw Error("DataParallel replica " + std::to_string(k) + " (" + devices[k].str() +
                  ") failed: " + e.what());
    }
  }
}

}  // namespace

DataParallel::DataParallel(torch::nn::Sequential model, std::vector<at::Device> devices)
    : devices_(std::move(devices)) {
  if (devices_.empty()) throw UsageError("DataParallel needs at least one device");
  model->to(devices_[0]);
  replicas_.push_back(model);
  for (size_t k = 1; k < devices_.size(); ++k) {
    replicas_.push_back(
        std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone(devices_[k])));
  }
}

DataParallel::DataParallel(const std::function<torch::nn::Sequential()>& make,
                           std::vector<at::Device> devices)
    : devices_(std::move(devices)) {
  if (devices_.empty()) throw UsageError("DataParallel needs at least one device");
  for (size_t k = 0; k < devices_.size(); ++k) {
    auto replica = make();
    replica->to(devices_[k]);
    if (k > 0 && replica->parameters().size() != replicas_[0]->parameters().size()) {
      throw UsageError("DataParallel: the replica factory built models of different shapes");
    }
    replicas_.push_back(replica);
  }
  sync_replicas();
}

void DataParallel::sync_replicas() {
  torch::NoGradGuard no_grad;
  auto params = replicas_[0]->parameters();
  auto buffers = replicas_[0]->buffers();
  for (size_t k = 1; k < replicas_.size(); ++k) {
    auto p = replicas_[k]->parameters();
    for (size_t i = 0; i < p.size(); ++i) p[i].copy_(params[i]);
    auto b = replicas_[k]->buffers();
    for (size_t i = 0; i < b.size(); ++i) b[i].copy_(buffers[i]);
  }
}

at::Tensor DataParallel::forward(const at::Tensor& input) {
  sync_replicas();
  auto xs = split_microbatches(input, static_cast<int>(replicas_.size()));
  std::vector<at::Tensor> outs(xs.size());
  on_each(xs.size(), devices_, [&](size_t k) {
    outs[k] = replicas_[k]->forward(xs[k].to(devices_[k])).to(devices_[0]);
  });
  return at::cat(outs);
}

at::Tensor DataParallel::train_step(
    const at::Tensor& input, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_fn) {
  sync_replicas();
  auto xs = split_microbatches(input, static_cast<int>(replicas_.size()));
  auto ys = split_microbatches(target, static_cast<int>(replicas_.size()));
  const double total = static_cast<double>(input.size(0));
  std::vector<at::Tensor> losses(xs.size());
  // Replicas other than the primary start each step from empty gradients.
  for (size_t k = 1; k < replicas_.size(); ++k) {
    for (auto& p : replicas_[k]->parameters()) p.mutable_grad() = at::Tensor();
  }
  on_each(xs.size(), devices_, [&](size_t k) {
    const double share = static_cast<double>(xs[k].size(0)) / total;
    auto out = replicas_[k]->forward(xs[k].to(devices_[k]));
    losses[k] = loss_fn(out, ys[k].to(devices_[k])) * share;
    losses[k].backward();
  });
  torch::NoGradGuard no_grad;
  auto primary = replicas_[0]->parameters();
  for (size_t k = 1; k < xs.size(); ++k) {
    auto p = replicas_[k]->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      if (!p[i].grad().defined()) continue;
      auto g = p[i].grad().to(devices_[0]);
      if (primary[i].grad().defined()) {
        primary[i].mutable_grad().add_(g);
      } else {
        primary[i].mutable_grad() = g.clone();
      }
    }
  }
  at::Tensor sum = losses[0].detach().to(devices_[0]);
  for (size_t k = 1; k < losses.size(); ++k) sum = sum + losses[k].detach().to(devices_[0]);
  return sum;
}

}  // namespace scaletrain
