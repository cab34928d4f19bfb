#pragma once
// A model as a chain of blocks: the form in which pipelines split a model into stages
// (pipeline.h, dist_pipeline.h). Each block registers some of the model's own submodules (so the
// chain's parameters are the model's tensors, not copies: training one trains the other) and
// runs a function of the previous block's output over them.
//
//   struct NetImpl : torch::nn::Module {                       // the user's model
//     torch::nn::Conv2d conv{...}; torch::nn::Linear fc{...};
//     at::Tensor forward(const at::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
//   };
//   auto net = std::make_shared<NetImpl>();
//   torch::nn::Sequential chain({
//       {"conv", scaletrain::Block(scaletrain::BlockParts{{"conv", net->conv.ptr()}},
//                                  [net](const at::Tensor& x) { return torch::relu(net->conv(x));
//                                  })},
//       {"fc", scaletrain::Block(scaletrain::BlockParts{{"fc", net->fc.ptr()}},
//                                [net](const at::Tensor& x) { return net->fc(x.flatten(1)); })},
//   });
//   scaletrain::check_chain(*net, chain, sample);   // the same tensors and the same function
//
// A Model with a block form gives its chain through as_sequential() (model.h).

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain {

/// Named submodules of a model, shared with a block.
using BlockParts = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;

/// One block: registers `parts` under their names and applies `fn` to its input. `fn` may
/// capture the model (or the parts) and call them; it must use only the parts' parameters.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const BlockParts& parts, std::function<at::Tensor(const at::Tensor&)> fn);
  at::Tensor forward(const at::Tensor& x) { return fn_(x); }

 private:
  std::function<at::Tensor(const at::Tensor&)> fn_;
};
TORCH_MODULE(Block);

/// Checks that `chain` is `model` in block form: every parameter of the chain is one of the
/// model's own tensors (not a copy), every parameter of the model is in the chain, and the chain's
/// forward on `sample` equals `model_forward(sample)` bit for bit (no grad). Throws UsageError
/// naming the first parameter that is missing or copied, or the largest difference.
void check_chain(const torch::nn::Module& model, torch::nn::Sequential chain,
                 const std::function<at::Tensor(const at::Tensor&)>& model_forward,
                 const at::Tensor& sample);

}  // namespace scaletrain
