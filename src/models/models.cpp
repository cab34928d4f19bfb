#include "scaletrain/models.h"

#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

namespace F = torch::nn::functional;

struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const ModelOptions& o) {
    fc1 = register_module("fc1", torch::nn::Linear(o.in_features, o.hidden));
    fc2 = register_module("fc2", torch::nn::Linear(o.hidden, o.num_classes));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct LeNetImpl : torch::nn::Module {
  explicit LeNetImpl(const ModelOptions& o) {
    conv1 = register_module("conv1", torch::nn::Conv2d(o.in_channels, 20, 3));
    conv2 = register_module("conv2", torch::nn::Conv2d(20, 50, 5));
    fc1 = register_module("fc1", torch::nn::Linear(800, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, o.num_classes));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto pool = F::AvgPool2dFuncOptions(2);
    auto h = F::avg_pool2d(torch::relu(conv1(x)), pool);
    h = F::avg_pool2d(torch::relu(conv2(h)), pool);
    return fc2(torch::relu(fc1(h.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

template <class M>
Model wrap(const std::string& name, std::shared_ptr<M> m) {
  return {name, m, [m](const at::Tensor& x) { return m->forward(x); }};
}

}  // namespace

std::vector<std::string> model_names() { return {"toy", "mlp", "lenet"}; }

Model make_model(const std::string& name, const ModelOptions& o) {
  if (name == "toy") return wrap(name, std::make_shared<ToyModelImpl>());
  if (name == "mlp") return wrap(name, std::make_shared<MLPImpl>(o));
  if (name == "lenet") return wrap(name, std::make_shared<LeNetImpl>(o));
  std::string known;
  for (auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown model '" + name + "'; the models are: " + known);
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace scaletrain
