#pragma once
// Single-process data parallelism (seeds 001, 003, 004): one replica of the model per device,
// kept from step to step (LibTorch's torch::nn::parallel::data_parallel clones the module on
// every call), the batch scattered, one thread per replica, gradients summed onto the primary
// replica, outputs gathered on the first device. A device may repeat (`cpu,cpu`).
//
//   auto net = std::make_shared<Net>();                          // any module: forward(Tensor)
//   scaletrain::DataParallel dp(net, {at::kCPU, at::kCPU});      // Net cloneable, or:
//   scaletrain::DataParallel dp(net, [] { return std::make_shared<Net>(); }, devices);
//   torch::optim::SGD opt(dp.parameters(), 0.1);                 // the primary's parameters
//   opt.zero_grad();
//   auto loss = dp.train_step(x, y, loss_fn);   // gradients now on the primary
//   opt.step();                                 // replicas pick the new values up next step
//
// Replicas: clones of the module when its type derives from torch::nn::Cloneable (Sequential,
// Linear, a TORCH_MODULE of a Cloneable); for other modules, a factory builds one of the same
// architecture per further device and DataParallel gives it the primary's parameters and
// buffers, before every step. The module given is the primary replica, on devices[0].
//
// Micro-batch losses are weighted by their share of the batch, so the primary's gradients
// equal the whole batch's for losses that average over samples. BatchNorm statistics are per
// replica (as in PyTorch's DataParallel); buffers are copied from the primary each step.
// An exception in a replica's thread is raised on the caller's thread. One caller at a time.

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <vector>

#include "scaletrain/module_call.h"

namespace scaletrain {

class DeviceThreads;  // src/runtime/device_threads.h

class DataParallel {
 public:
  /// `module` becomes the primary replica on devices[0]; the others are its clones. Throws
  /// UsageError for an empty device list, and when more than one device needs clones of a
  /// module whose type is not torch::nn::Cloneable (then give a factory, below).
  template <typename M>
  DataParallel(std::shared_ptr<M> module, std::vector<at::Device> devices)
      : DataParallel(primary_and_clones(std::move(module), devices), devices) {}
  /// For modules that cannot be cloned: `make` builds one more replica (the same architecture)
  /// per further device; they take the primary's parameters and buffers.
  template <typename M>
  DataParallel(std::shared_ptr<M> module, const std::function<std::shared_ptr<M>()>& make,
               std::vector<at::Device> devices)
      : DataParallel(primary_and_made(std::move(module), make, devices), devices) {}
  /// A module holder (torch::nn::Sequential, a TORCH_MODULE).
  template <typename Impl>
  DataParallel(torch::nn::ModuleHolder<Impl> module, std::vector<at::Device> devices)
      : DataParallel(module.ptr(), std::move(devices)) {}
  /// A replica: its module and how to call it.
  struct Replica {
    std::shared_ptr<torch::nn::Module> module;
    TensorFn forward;
  };
  /// Replicas already built, one per device, the first being the primary: the others take its
  /// parameters and buffers. Throws UsageError when their parameters differ in count or shape.
  DataParallel(std::vector<Replica> replicas, std::vector<at::Device> devices);
  /// Every replica from a factory, the first being the primary (a model as a block chain).
  ///   DataParallel dp([] { return as_sequential(make_net()); }, devices);
  DataParallel(const std::function<torch::nn::Sequential()>& make, std::vector<at::Device> devices);

  /// Outputs of the whole batch, scattered over the replicas and gathered on devices[0].
  at::Tensor forward(const at::Tensor& input);

  /// Forward and backward of the whole batch; gradients are summed onto the primary's
  /// parameters (accumulated into what is there). Returns the batch's loss.
  at::Tensor train_step(
      const at::Tensor& input, const at::Tensor& target,
      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss);

  /// The primary replica's parameters: give these to the optimizer.
  std::vector<at::Tensor> parameters() const { return replicas_[0].module->parameters(); }
  /// The replicas' modules, the primary first.
  std::vector<std::shared_ptr<torch::nn::Module>> replicas() const;
  const std::vector<at::Device>& devices() const { return devices_; }

 private:
  void sync_replicas();  // primary's parameters and buffers -> every other replica
  void on_each(size_t n, const std::function<void(size_t)>& fn);

  template <typename M>
  static Replica replica_of(std::shared_ptr<M> m) {
    static_assert(has_tensor_forward_v<M>,
                  "DataParallel needs a module whose forward takes one tensor and returns one");
    return {std::static_pointer_cast<torch::nn::Module>(m), tensor_forward(m)};
  }
  static void check_devices(const std::vector<at::Device>& devices);
  [[noreturn]] static void not_cloneable();

  template <typename M>
  static std::vector<Replica> primary_and_clones(std::shared_ptr<M> module,
                                                 const std::vector<at::Device>& devices) {
    check_devices(devices);
    std::vector<Replica> out{replica_of(module)};
    for (size_t k = 1; k < devices.size(); ++k) {
      if constexpr (std::is_base_of_v<torch::nn::Cloneable<M>, M>) {
        out.push_back(replica_of(std::dynamic_pointer_cast<M>(module->clone(devices[k]))));
      } else {
        not_cloneable();
      }
    }
    return out;
  }
  template <typename M>
  static std::vector<Replica> primary_and_made(std::shared_ptr<M> module,
                                               const std::function<std::shared_ptr<M>()>& make,
                                               const std::vector<at::Device>& devices) {
    check_devices(devices);
    std::vector<Replica> out{replica_of(module)};
    for (size_t k = 1; k < devices.size(); ++k) out.push_back(replica_of(make()));
    return out;
  }

  std::vector<Replica> replicas_;
  std::vector<at::Device> devices_;
  std::shared_ptr<DeviceThreads> threads_;  // one per replica, made at the first step
};

}  // namespace scaletrain
