#include "zoo_models.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>

#include <map>
#include <set>

#include "scaletrain/error.h"
#include "scaletrain/intra_op_threads.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

std::vector<std::string> names(const Model& m) {
  std::vector<std::string> out;
  for (auto& p : m.module->named_parameters()) out.push_back(p.key());
  return out;
}

TEST(Models, LeNetHasTheSeedsShapeAndNames) {
  Model m = make_model("lenet");
  // conv1 20x1x3x3+20, conv2 50x20x5x5+50, fc1 800x128+128, fc2 128x10+10
  EXPECT_EQ(parameter_count(*m.module), 200 + 25050 + 102528 + 1290);
  EXPECT_EQ(names(m),
            (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                      "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ(m.forward(at::zeros({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
}

TEST(Models, ToyModelOfSeed000) {
  Model m = make_model("toy");
  EXPECT_EQ(parameter_count(*m.module), 10 * 10 + 10 + 10 * 5 + 5);
  EXPECT_EQ(names(m).front(), "net1.weight");
  EXPECT_EQ(m.forward(at::zeros({20, 10})).sizes(), (std::vector<int64_t>{20, 5}));
}

TEST(Models, MlpFlattensImages) {
  Model m = make_model("mlp");
  EXPECT_EQ(parameter_count(*m.module), 784 * 256 + 256 + 256 * 10 + 10);
  EXPECT_EQ(m.forward(at::zeros({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
}

TEST(Models, SmallImageResNet18) {
  Model m = make_model("resnet18");
  // torchvision's resnet18 has 11,689,512 parameters with a 7x7x3 stem and 1000 classes; the
  // small-image variant has a 3x3x1 stem (-9408 + 576) and 10 classes (-513000 + 5130).
  EXPECT_EQ(parameter_count(*m.module), 11689512 - 9408 + 576 - 513000 + 5130);
  auto n = names(m);
  EXPECT_NE(std::find(n.begin(), n.end(), "layer2.0.downsample.0.weight"), n.end());
  EXPECT_NE(std::find(n.begin(), n.end(), "layer4.1.bn2.bias"), n.end());
  EXPECT_EQ(m.forward(at::zeros({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
}

TEST(Models, ResNet50And101MatchTorchvision) {
  ModelOptions imagenet;
  imagenet.in_channels = 3;
  imagenet.num_classes = 1000;
  Model r50 = make_model("resnet50", imagenet);
  EXPECT_EQ(parameter_count(*r50.module), 25557032);  // torchvision.models.resnet50()
  EXPECT_EQ(parameter_count(*make_model("resnet101", imagenet).module), 44549160);
  auto n = names(r50);
  EXPECT_EQ(n.front(), "conv1.weight");
  EXPECT_NE(std::find(n.begin(), n.end(), "layer3.5.conv3.weight"), n.end());
  EXPECT_NE(std::find(n.begin(), n.end(), "layer1.0.downsample.1.bias"), n.end());
  EXPECT_EQ(n.back(), "fc.bias");
  size_t buffers = r50.module->named_buffers().size();
  EXPECT_EQ(buffers, 53u * 3);  // running_mean, running_var, num_batches_tracked per BN
  EXPECT_EQ(r50.forward(at::zeros({1, 3, 64, 64})).sizes(), (std::vector<int64_t>{1, 1000}));
}

TEST(Models, UnknownNameListsTheKnownOnes) {
  try {
    make_model("resnet9000");
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("toy, mlp, lenet, resnet18, resnet50, resnet101"),
              std::string::npos)
        << e.what();
  }
}

// Every model's block chain computes the model's forward with the model's own parameters, so a
// pipeline of the blocks is the model.
TEST(Models, BlockChainEqualsTheModel) {
  struct Case {
    std::string name;
    ModelOptions options;
    std::vector<int64_t> input;
    size_t blocks;
  };
  ModelOptions rgb;
  rgb.in_channels = 3;
  const std::vector<Case> cases = {{"toy", {}, {4, 10}, 2},
                                   {"mlp", {}, {4, 1, 28, 28}, 2},
                                   {"lenet", {}, {4, 1, 28, 28}, 4},
                                   {"resnet18", {}, {2, 1, 28, 28}, 1 + 8 + 1},
                                   {"resnet50", rgb, {2, 3, 64, 64}, 1 + 16 + 1}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(1);
    Model m = make_model(c.name, c.options);
    m.module->eval();
    auto seq = as_sequential(m);
    seq->eval();
    EXPECT_EQ(seq->size(), c.blocks);
    EXPECT_EQ(parameter_count(*seq), parameter_count(*m.module));
    // The same tensors, not copies.
    std::set<const void*> own;
    for (auto& p : m.module->parameters()) own.insert(p.data_ptr());
    for (auto& p : seq->parameters()) EXPECT_TRUE(own.count(p.data_ptr())) << "a copied parameter";
    auto x = at::randn(c.input);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(seq->forward(x), m.forward(x)))  // the same kernels in the same order
        << "the block chain computes another function";
  }
  Model r = make_model("resnet50", rgb);
  auto seq = as_sequential(r);
  EXPECT_EQ(seq->named_children()[0].key(), "stem");
  EXPECT_EQ(seq->named_children()[16].key(), "layer4_2");
  EXPECT_EQ(seq->named_children()[17].key(), "head");
}

// LeNet reads only the rows and columns its floor-rounding pools keep (Note [Unread border]): its
// output and gradients equal the uncropped layers' (LibTorch's conv, relu, avg_pool), for both
// input sizes LeNet takes and both memory formats, through the model and its block chain. Both
// are held to the exact (float64) uncropped function's values (Note [Tolerances]).
// The names of every autograd node behind `out`.
std::set<std::string> graph_nodes(const at::Tensor& out) {
  std::set<std::string> names;
  std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return names;
}

bool any_contains(const std::set<std::string>& names, const std::string& part) {
  for (const auto& n : names) {
    if (n.find(part) != std::string::npos) return true;
  }
  return false;
}

// Without model_optimizations, the zoo's models are what a Python user writes: LibTorch's ops
// only (no custom autograd node), and LeNet is the uncropped composition bit for bit, forward
// and backward, in both memory formats, so a comparison with a Python peer measures the
// framework alone.
TEST(Models, WithoutModelOptimizationsTheZooRunsLibTorchsOpsOnly) {
  namespace F = torch::nn::functional;
  for (const std::string name : {"lenet", "resnet18"}) {
    for (bool optimized : {true, false}) {
      ModelOptions o;
      o.model_optimizations = optimized;
      torch::manual_seed(4);
      Model m = make_model(name, o);
      to_channels_last(*m.module);
      auto x = at::randn({2, 1, 28, 28}).contiguous(at::MemoryFormat::ChannelsLast);
      auto nodes = graph_nodes(m.forward(x));
      auto chain_nodes = graph_nodes(as_sequential(m)->forward(x));
      EXPECT_EQ(any_contains(nodes, "CppNode"), optimized) << name << ", optimized " << optimized;
      EXPECT_EQ(any_contains(chain_nodes, "CppNode"), optimized)
          << name << " block chain, optimized " << optimized;
      EXPECT_EQ(any_contains(nodes, "StemConv"), optimized) << name;
    }
  }
  ModelOptions plain;
  plain.model_optimizations = false;
  for (bool channels_last : {false, true}) {
    torch::manual_seed(5);
    Model m = make_model("lenet", plain);
    auto x = at::randn({3, 1, 28, 28});
    if (channels_last) {
      to_channels_last(*m.module);
      x = x.contiguous(at::MemoryFormat::ChannelsLast);
    }
    auto p = m.module->named_parameters();
    std::map<std::string, at::Tensor> leaves;
    for (auto& item : p) leaves[item.key()] = item.value().detach().clone().requires_grad_(true);
    auto pool = [](const at::Tensor& t) {
      return F::avg_pool2d(torch::relu(t), F::AvgPool2dFuncOptions(2));
    };
    auto h = pool(at::conv2d(x, leaves["conv1.weight"], leaves["conv1.bias"]));
    h = pool(at::conv2d(h, leaves["conv2.weight"], leaves["conv2.bias"])).flatten(1);
    h = torch::relu(at::linear(h, leaves["fc1.weight"], leaves["fc1.bias"]));
    auto ref = at::linear(h, leaves["fc2.weight"], leaves["fc2.bias"]);
    auto out = m.forward(x);
    EXPECT_TRUE(at::equal(out, ref)) << "channels-last " << channels_last;
    auto g = at::randn_like(ref);
    out.backward(g);
    ref.backward(g);
    for (auto& item : p) {
      EXPECT_TRUE(at::equal(item.value().grad(), leaves[item.key()].grad()))
          << item.key() << ", channels-last " << channels_last;
    }
  }
}

TEST(Models, LeNetEqualsItsUncroppedLayers) {
  namespace F = torch::nn::functional;
  auto uncropped = [](torch::nn::Module& m, const at::Tensor& in) {
    auto p = m.named_parameters();
    auto conv = [&](const at::Tensor& t, const std::string& name) {
      return at::conv2d(t, p[name + ".weight"], p[name + ".bias"]);
    };
    auto pool = [](const at::Tensor& t) {
      return F::avg_pool2d(torch::relu(t), F::AvgPool2dFuncOptions(2));
    };
    auto h = pool(conv(pool(conv(in, "conv1")), "conv2")).flatten(1);
    h = torch::relu(at::linear(h, p["fc1.weight"], p["fc1.bias"]));
    return at::linear(h, p["fc2.weight"], p["fc2.bias"]);
  };
  const int64_t batch = 5;
  for (int64_t size : {28, 29}) {
    // Terms along the longest chain: the forward's fan-ins (conv1 9+1, pool 4, conv2 500+1,
    // pool 4, fc1 800+1, fc2 128+1), the backward's fan-outs down to conv1's input (fc2 10,
    // fc1 128, pool 1, conv2 50x25, pool 1, conv1 20x9) and conv1's weight gradient, summed
    // over the batch and its (size-2)^2 output pixels.
    const double terms = (10 + 4 + 501 + 4 + 801 + 129) + (10 + 128 + 1 + 1250 + 1 + 180) +
                         static_cast<double>(batch * (size - 2) * (size - 2));
    for (bool channels_last : {false, true}) {
      const std::string what = std::to_string(size) + (channels_last ? " NHWC" : " NCHW");
      torch::manual_seed(3);
      Model m = make_model("lenet");
      auto x = at::randn({batch, 1, size, size});
      if (channels_last) {
        to_channels_last(*m.module);
        x = x.contiguous(at::MemoryFormat::ChannelsLast);
      }
      auto g = at::randn({batch, 10});
      auto exact = testing::exact_and_magnitudes([] { return make_model("lenet").module; },
                                                 uncropped, testing::weights_of(*m.module), x,
                                                 [&](const at::Tensor&, const at::Tensor&) {
                                                   auto gd = g.to(at::kDouble);
                                                   return testing::LossGradient{gd, gd.abs()};
                                                 });
      auto p = m.module->named_parameters();
      auto check = [&](const at::Tensor& out, const at::Tensor& x_grad, const std::string& where) {
        ASSERT_EQ(out.sizes(), exact.output.sizes()) << where;
        EXPECT_TRUE(testing::within_rounding(out, exact.output, exact.output_magnitude, terms))
            << where << ", output";
        size_t i = 0;
        for (auto& item : p) {
          EXPECT_TRUE(testing::within_rounding(item.value().grad(), exact.grads[i],
                                               exact.grad_magnitudes[i], terms))
              << where << " " << item.key();
          ++i;
        }
        EXPECT_TRUE(
            testing::within_rounding(x_grad, exact.input_grad, exact.input_grad_magnitude, terms))
            << where << ", input gradient";
      };
      {  // LibTorch's uncropped layers in float: the reference itself meets the bound.
        auto x_ref = x.clone().requires_grad_(true);
        auto ref = uncropped(*m.module, x_ref);
        ref.backward(g);
        check(ref, x_ref.grad(), what + ", uncropped layers");
      }
      auto seq = as_sequential(m);
      for (int path = 0; path < 2; ++path) {
        m.module->zero_grad();
        auto xi = x.clone().requires_grad_(true);
        auto out = path == 0 ? m.forward(xi) : seq->forward(xi);
        out.backward(g);
        check(out, xi.grad(), what + (path == 0 ? ", model" : ", block chain"));
      }
    }
  }
}

}  // namespace
}  // namespace scaletrain
