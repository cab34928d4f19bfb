#pragma once
// Single-process data parallelism (seeds 001, 003, 004): one replica of the model per device,
// kept from step to step (LibTorch's torch::nn::parallel::data_parallel clones the module on
// every call), the batch scattered, one thread per replica, gradients summed onto the primary
// replica, outputs gathered on the first device. A device may repeat (`cpu,cpu`).
//
//   scaletrain::DataParallel dp(model, {at::kCPU, at::kCPU});   // model: a Sequential
//   torch::optim::SGD opt(dp.parameters(), 0.1);                  // the primary's parameters
//   opt.zero_grad();
//   auto loss = dp.train_step(x, y, loss_fn);   // gradients now on the primary
//   opt.step();                                 // replicas pick the new values up next step
//
// Micro-batch losses are weighted by their share of the batch, so the primary's gradients
// equal the whole batch's for losses that average over samples. BatchNorm statistics are per
// replica (as in PyTorch's DataParallel); buffers are copied from the primary each step.
// An exception in a replica's thread is raised on the caller's thread. One caller at a time.

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <vector>

namespace scaletrain {

class DataParallel {
 public:
  /// `model` becomes the primary replica on devices[0]; the others are clones. Throws
  /// UsageError for an empty device list.
  DataParallel(torch::nn::Sequential model, std::vector<at::Device> devices);

  /// For models that cannot be cloned (modules not derived from torch::nn::Cloneable, such as
  /// the zoo's block chains): `make` builds each replica, the first is the primary, and the
  /// others take its parameters and buffers.
  ///   DataParallel dp([] { return as_sequential(make_model("resnet18")); }, devices);
  DataParallel(const std::function<torch::nn::Sequential()>& make, std::vector<at::Device> devices);

  /// Outputs of the whole batch, scattered over the replicas and gathered on devices[0].
  at::Tensor forward(const at::Tensor& input);

  /// Forward and backward of the whole batch; gradients are summed onto the primary's
  /// parameters (accumulated into what is there). Returns the batch's loss.
  at::Tensor train_step(
      const at::Tensor& input, const at::Tensor& target,
      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss);

  /// The primary replica's parameters: give these to the optimizer.
  std::vector<at::Tensor> parameters() const { return replicas_[0]->parameters(); }
  const std::vector<torch::nn::Sequential>& replicas() const { return replicas_; }

 private:
  void sync_replicas();  // primary's parameters and buffers -> every other replica

  std::vector<torch::nn::Sequential> replicas_;
  std::vector<at::Device> devices_;
};

}  // namespace scaletrain
