#pragma once
// A small model of a test's own, 6 -> W -> W -> 3 with ReLUs, as a user would write it, in three
// blocks (the pipeline strategies and ZeRO-3's units split it).

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <mutex>

#include "scaletrain/blocks.h"
#include "scaletrain/trainer.h"

namespace scaletrain::testing {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t width = 8)
      : a(register_module("a", torch::nn::Linear(6, width))),
        b(register_module("b", torch::nn::Linear(width, width))),
        c(register_module("c", torch::nn::Linear(width, 3))) {}
  torch::nn::Linear a, b, c;
  at::Tensor forward(const at::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
};

/// `net` as the trainer's Model, with its three blocks.
inline Model model_of_net(const std::shared_ptr<NetImpl>& net) {
  return model_of(net, "net", [net] {
    return torch::nn::Sequential(
        {{"a", Block(BlockParts{{"a", net->a.ptr()}},
                     [net](const at::Tensor& x) { return torch::relu(net->a(x)); })},
         {"b", Block(BlockParts{{"b", net->b.ptr()}},
                     [net](const at::Tensor& x) { return torch::relu(net->b(x)); })},
         {"c", Block(BlockParts{{"c", net->c.ptr()}},
                     [net](const at::Tensor& x) { return net->c(x); })}});
  });
}

/// A fresh NetImpl (width 8) as the trainer's Model, its start drawn from a generator of its
/// own, so ranks run as threads all start alike. `mu`: ranks are threads, one model at a time.
inline Model net_model(std::mutex& mu) {
  std::lock_guard<std::mutex> lock(mu);
  auto net = std::make_shared<NetImpl>();
  auto init = at::make_generator<at::CPUGeneratorImpl>(3);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), init) * 0.3);
  return model_of_net(net);
}

}  // namespace scaletrain::testing
