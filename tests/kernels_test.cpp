// The CPU kernels of src/kernels/ops.h against LibTorch's ops: the stem convolution's own weight
// gradient within the bound of its arithmetic (Note [Tolerances]), the fused relu + pool bit for
// bit.

#include "kernels/ops.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>

#include "scaletrain/intra_op_threads.h"
#include "support/tolerance.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

// The stem convolution's own weight gradient (Note [Stem conv]) against the exact (float64) one,
// for the shapes and options it takes, in both memory formats, with and without an input
// gradient; LibTorch's gradient is held to the same bound (Note [Tolerances]). The weight
// gradient sums batch x output pixels products per element (+1 for the bias's sum).
TEST(Kernels, StemConvGradientsEqualLibTorchs) {
  namespace nn = torch::nn;
  struct Case {
    nn::Conv2dOptions options;
    int64_t size;
  };
  const std::vector<Case> cases = {
      {nn::Conv2dOptions(1, 20, 3), 28},                                       // LeNet's conv1
      {nn::Conv2dOptions(1, 64, 3).padding(1).bias(false), 28},                // ResNet-18 stem
      {nn::Conv2dOptions(3, 8, 3).stride(2).padding({1, 2}).dilation(2), 17},  // odd options
      {nn::Conv2dOptions(2, 5, {4, 2}), 12},                                   // K = 16
      {nn::Conv2dOptions(1, 6, {4, 5}).stride({2, 1}).padding({2, 0}), 15},    // odd, one channel
  };
  const int64_t budget = stem_unfold_bytes();
  for (const auto& c : cases) {
    for (bool channels_last : {false, true}) {
      for (bool input_grad : {false, true}) {
        // Regression (stem unfold unbounded): the batch is unfolded in slices of at most
        // stem_unfold_bytes(); with input gradients, this case takes one sample at a time.
        set_stem_unfold_bytes(input_grad ? 1 : budget);
        torch::manual_seed(1);
        nn::Conv2d conv(c.options);
        auto fmt = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
        if (channels_last) to_channels_last(*conv);
        auto x = at::randn({6, c.options.in_channels(), c.size, c.size}).contiguous(fmt);
        auto x_ref = x.clone().set_requires_grad(input_grad);
        x.set_requires_grad(input_grad);
        const std::string what = std::string(channels_last ? "NHWC" : "NCHW") +
                                 (input_grad ? ", input grad, one sample per slice" : "") +
                                 ", in_channels " + std::to_string(c.options.in_channels());
        auto y = conv2d(conv, x);
        ASSERT_TRUE(y.grad_fn());
        // One input channel only: on a 224x224 RGB stem oneDNN's own gradient is faster.
        EXPECT_EQ(y.grad_fn()->name().find("StemConv") != std::string::npos,
                  c.options.in_channels() == 1)
            << what << ": took " << y.grad_fn()->name();
        auto gy = at::randn_like(y);
        y.backward(gy);
        set_stem_unfold_bytes(budget);
        auto gw = conv->weight.grad().clone();
        auto gb = conv->bias.defined() ? conv->bias.grad().clone() : at::Tensor();
        conv->zero_grad();
        auto y_ref = conv->forward(x_ref);
        y_ref.backward(gy);
        EXPECT_TRUE(at::equal(y, y_ref)) << what;
        EXPECT_EQ(gw.strides(), conv->weight.strides()) << what;
        if (input_grad) {
          EXPECT_TRUE(at::equal(x.grad(), x_ref.grad())) << what;
        }
        auto exact = testing::exact_and_magnitudes(
            [&] { return std::make_shared<nn::Conv2dImpl>(c.options); },
            [](torch::nn::Module& m, const at::Tensor& in) {
              return static_cast<nn::Conv2dImpl&>(m).forward(in);
            },
            testing::weights_of(*conv), x,
            [&](const at::Tensor&, const at::Tensor&) {
              auto g = gy.to(at::kDouble);
              return testing::LossGradient{g, g.abs()};
            });
        const double terms = static_cast<double>(gy.numel() / gy.size(1)) + 1;
        EXPECT_TRUE(testing::within_rounding(gw, exact.grads[0], exact.grad_magnitudes[0], terms))
            << what << ", ours";
        EXPECT_TRUE(testing::within_rounding(conv->weight.grad(), exact.grads[0],
                                             exact.grad_magnitudes[0], terms))
            << what << ", LibTorch's";
        if (gb.defined()) {
          EXPECT_TRUE(testing::within_rounding(gb, exact.grads[1], exact.grad_magnitudes[1], terms))
              << what;
        }
      }
    }
  }
}

TEST(Kernels, StemConvLeavesOtherConvolutionsToLibTorch) {
  namespace nn = torch::nn;
  nn::Conv2d wide(nn::Conv2dOptions(20, 50, 5));  // K = 500: oneDNN's own kernel is faster
  EXPECT_EQ(conv2d(wide, at::randn({2, 20, 13, 13})).grad_fn()->name(), "ConvolutionBackward0");
  nn::Conv2d stem(nn::Conv2dOptions(1, 4, 3));
  torch::NoGradGuard no_grad;  // inference: no autograd node at all
  EXPECT_FALSE(conv2d(stem, at::randn({2, 1, 8, 8})).grad_fn());
}

// The fused relu + 2x2 average pool (Note [Fused ReLU + pool]) against LibTorch's two ops: the
// same values and input gradients, bit for bit, for even and odd sizes, on one and two threads.
TEST(Kernels, FusedReluPoolEqualsLibTorchs) {
  namespace F = torch::nn::functional;
  for (int t : {1, 2}) {
    IntraOpThreads threads(t);
    for (auto shape : std::vector<std::vector<int64_t>>{
             {6, 20, 26, 26}, {6, 50, 9, 9}, {3, 5, 7, 8}, {1, 3, 2, 3}}) {
      torch::manual_seed(2);
      auto x = at::randn(shape).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
      auto x_ref = x.detach().clone().requires_grad_(true);
      const std::string what = std::to_string(shape[1]) + "x" + std::to_string(shape[2]) + "x" +
                               std::to_string(shape[3]) + ", " + std::to_string(t) + " thread(s)";
      auto y = relu_avg_pool2x2(x);
      EXPECT_NE(y.grad_fn()->name().find("ReluAvgPool"), std::string::npos) << what;
      auto y_ref = F::avg_pool2d(torch::relu(x_ref), F::AvgPool2dFuncOptions(2));
      ASSERT_EQ(y.sizes(), y_ref.sizes()) << what;
      EXPECT_TRUE(at::equal(y, y_ref)) << what;
      auto g = at::randn_like(y_ref);
      y.backward(g);
      y_ref.backward(g);
      EXPECT_TRUE(at::equal(x.grad(), x_ref.grad()))
          << what << ": max diff " << (x.grad() - x_ref.grad()).abs().max().item<float>();
    }
  }
  // Another layout takes LibTorch's ops, with the same result.
  auto x = at::randn({2, 4, 6, 6});
  EXPECT_TRUE(
      at::equal(relu_avg_pool2x2(x), F::avg_pool2d(torch::relu(x), F::AvgPool2dFuncOptions(2))));
}

}  // namespace
}  // namespace scaletrain
