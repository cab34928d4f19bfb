// A user's model as a chain of blocks (blocks.h): the chain shares the model's tensors and
// computes its function; check_chain() names what is wrong with a chain that does not.

#include "scaletrain/blocks.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "scaletrain/error.h"
#include "scaletrain/pipeline.h"

namespace scaletrain {
namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};

torch::nn::Sequential chain_of(const std::shared_ptr<NetImpl>& net) {
  return torch::nn::Sequential(
      {{"conv", Block(BlockParts{{"conv", net->conv.ptr()}},
                      [net](const at::Tensor& x) { return torch::relu(net->conv(x)); })},
       {"fc", Block(BlockParts{{"fc", net->fc.ptr()}},
                    [net](const at::Tensor& x) { return net->fc(x.flatten(1)); })}});
}

TEST(Blocks, ChainSharesTheModelsTensorsAndFunction) {
  auto net = std::make_shared<NetImpl>();
  auto chain = chain_of(net);
  auto x = at::randn({2, 1, 8, 8});
  auto fwd = [net](const at::Tensor& t) { return net->forward(t); };
  EXPECT_NO_THROW(check_chain(*net, chain, fwd, x));
  {  // training the chain trains the model
    torch::NoGradGuard g;
    chain->parameters()[0].add_(1);
  }
  EXPECT_TRUE(at::equal(chain->parameters()[0], net->conv->weight));
  // It pipelines over two stages like any Sequential.
  PipelineOptions o;
  o.balance = {1, 1};
  o.devices = {at::kCPU, at::kCPU};
  Pipeline pipe(chain, o);
  torch::NoGradGuard g;
  EXPECT_TRUE(at::equal(pipe.forward(x), net->forward(x)));
}

TEST(Blocks, CheckChainNamesACopiedParameterAMissingOneAndAnotherFunction) {
  auto net = std::make_shared<NetImpl>();
  auto x = at::randn({2, 1, 8, 8});
  auto fwd = [net](const at::Tensor& t) { return net->forward(t); };
  auto copied = torch::nn::Sequential(
      {{"conv", Block(BlockParts{{"conv", net->conv->clone()}},
                      [net](const at::Tensor& t) { return torch::relu(net->conv(t)); })},
       {"fc", Block(BlockParts{{"fc", net->fc.ptr()}},
                    [net](const at::Tensor& t) { return net->fc(t.flatten(1)); })}});
  try {
    check_chain(*net, copied, fwd, x);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'conv.conv.weight' is not one of the model's tensors"),
              std::string::npos)
        << e.what();
  }
  auto missing =
      torch::nn::Sequential({{"all", Block(BlockParts{{"conv", net->conv.ptr()}}, fwd)}});
  try {
    check_chain(*net, missing, fwd, x);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'fc.weight' is in no block"), std::string::npos)
        << e.what();
  }
  auto other = chain_of(net);
  other->push_back("extra", Block(BlockParts{}, [](const at::Tensor& t) { return t * 2; }));
  EXPECT_THROW(check_chain(*net, other, fwd, x), UsageError);
}

// A single module given to a pipeline of two stages: the error says how to split it.
TEST(Blocks, PipelineOfOneModuleSaysHowToSplitIt) {
  torch::nn::Sequential one(std::make_shared<NetImpl>());
  PipelineOptions o;
  o.balance = {1, 1};
  o.devices = {at::kCPU, at::kCPU};
  try {
    Pipeline pipe(one, o);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("scaletrain::Block in blocks.h"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace scaletrain
