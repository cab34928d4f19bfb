// CPU kernels for the zoo's layers, as autograd functions over LibTorch tensors; the loops
// themselves are in loops.cpp (LibTorch-free, built at -O3).

#include "kernels/ops.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/im2col.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>

#include <algorithm>
#include <atomic>

#include "kernels/loops.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

namespace F = torch::nn::functional;

// Note [Stem conv]
// ~~~~~~~~~~~~~~~~
// On the CPU, oneDNN computes the weight gradient of a convolution with one input channel (a
// stem over grey images: LeNet's conv1, the small-image ResNet-18's conv1) at about 2 GFLOP/s,
// a sixth of LeNet's training step. That gradient is a small reduction: for each of the
// K = C_in·kh·kw input taps and each output channel, the sum over the batch and the output
// pixels of input tap × output gradient. With the input unfolded (im2col: [B, K, L], L output
// pixels) and the output gradient seen as [B, L, C_out] (a view when it is channels-last), it
// is bmm(cols, grad).sum(0): [K, C_out], 5x faster here. The unfolded input is K times the
// input, so the path is kept to K <= 32, and the batch is unfolded a slice at a time, each
// slice's columns at most stem_unfold_bytes(), 32 MiB (a 224x224 RGB stem at batch 256 would
// otherwise unfold 1.4 GB at once). One input channel only: on that RGB stem oneDNN's own
// weight gradient is ~2.8x faster than this path (`scaletrain bench stem-conv`). The forward
// and the input gradient stay LibTorch's.
constexpr int64_t kStemMaxTaps = 32;
std::atomic<int64_t> stem_unfold_budget{int64_t{32} << 20};  // kStemUnfoldBytes

struct StemConvFunction : torch::autograd::Function<StemConvFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            std::vector<int64_t> stride, std::vector<int64_t> padding,
                            std::vector<int64_t> dilation) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["has_bias"] = bias.has_value();
    return at::conv2d(x, weight, bias, stride, padding, dilation);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const at::Tensor& g = grads[0];  // [B, C_out, H_out, W_out]
    const int64_t batch = g.size(0), c_out = g.size(1), pixels = g.size(2) * g.size(3);
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) {
      grad_x =
          std::get<0>(at::convolution_backward(g, x, w, std::nullopt, stride, padding, dilation,
                                               false, {0, 0}, 1, {true, false, false}));
    }
    if (ctx->needs_input_grad(1)) {
      const int64_t taps = w.size(1) * w.size(2) * w.size(3);
      const int64_t slice = std::max<int64_t>(
          1, stem_unfold_budget.load() / std::max<int64_t>(1, taps * pixels * x.element_size()));
      auto k_by_out = at::zeros({taps, c_out}, g.options());  // [K, C_out]
      for (int64_t b = 0; b < batch; b += slice) {
        const int64_t n = std::min(slice, batch - b);
        auto cols = at::im2col(x.narrow(0, b, n), {w.size(2), w.size(3)}, dilation, padding,
                               stride);  // [n, K, L]
        auto g_rows =
            g.narrow(0, b, n).permute({0, 2, 3, 1}).reshape({n, pixels, c_out});  // [n, L, C_out]
        auto part = at::bmm(cols, g_rows).sum(0);
        k_by_out.add_(part);
      }
      grad_w = at::empty_like(w);
      grad_w.copy_(k_by_out.t().reshape(w.sizes()));
    }
    // Gradient edges count tensor inputs only: the bias is edge 2 when there is one.
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_b = g.sum({0, 2, 3});
    }
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Note [Fused ReLU + pool]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// LeNet follows each convolution with relu and a 2x2 average pool. As two LibTorch ops they
// write the relu's output, read it back to pool, and in backward run avg_pool2d_backward (which
// zero-fills, then scatters) and threshold_backward: four passes over the largest activation of
// the model. Fused (src/kernels/loops.cpp) it is one read for the forward and one read-and-write
// for the backward, from the convolution's output, which the function keeps instead of the
// relu's (same size). On a CPU core that is ~5 ms of a ~95 ms LeNet step (batch 128). Channels-
// last float tensors on the CPU only; anything else takes the two LibTorch ops. The results are
// LibTorch's bit for bit (the same sum, in the same order, divided by 4), but for a non-finite
// gradient where the input is negative (0 · inf is NaN here, 0 there).
struct ReluAvgPoolFunction : torch::autograd::Function<ReluAvgPoolFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    const int64_t h = x.size(2), w = x.size(3), c = x.size(1);
    auto out = at::empty({x.size(0), c, h / 2, w / 2},
                         x.options().memory_format(at::MemoryFormat::ChannelsLast));
    const float* px = x.const_data_ptr<float>();
    float* po = out.mutable_data_ptr<float>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      kernels::relu_avg_pool2x2(px, po, begin, end, h, w, c);
    });
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous(at::MemoryFormat::ChannelsLast);
    auto gx = at::empty_like(x, at::MemoryFormat::ChannelsLast);
    const int64_t h = x.size(2), w = x.size(3), c = x.size(1);
    const float* px = x.const_data_ptr<float>();
    const float* pg = g.const_data_ptr<float>();
    float* pgx = gx.mutable_data_ptr<float>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      kernels::relu_avg_pool2x2_backward(px, pg, pgx, begin, end, h, w, c);
    });
    return {gx};
  }
};

}  // namespace

int64_t stem_unfold_bytes() { return stem_unfold_budget.load(); }
void set_stem_unfold_bytes(int64_t bytes) { stem_unfold_budget.store(bytes); }

at::Tensor conv2d(torch::nn::Conv2d conv, const at::Tensor& x) {
  const auto& o = conv->options;
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  const at::Tensor& w = conv->weight;
  const bool fast = x.device().is_cpu() && x.dim() == 4 && padding != nullptr && o.groups() == 1 &&
                    std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()) &&
                    w.requires_grad() && torch::GradMode::is_enabled() &&
                    x.scalar_type() == w.scalar_type() &&
                    !at::autocast::is_autocast_enabled(at::kCPU) && w.size(1) == 1 &&
                    w.size(2) * w.size(3) <= kStemMaxTaps;
  return fast ? stem_conv2d(conv, x) : conv->forward(x);
}

at::Tensor stem_conv2d(torch::nn::Conv2d conv, const at::Tensor& x) {
  const auto& o = conv->options;
  const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  if (padding == nullptr || o.groups() != 1 ||
      !std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    throw UsageError("stem_conv2d: the path takes numeric zero padding and groups 1");
  }
  auto vec = [](const torch::ExpandingArray<2>& a) {
    return std::vector<int64_t>(a->begin(), a->end());
  };
  std::optional<at::Tensor> bias;
  if (conv->bias.defined()) bias = conv->bias;
  return StemConvFunction::apply(x, conv->weight, bias, vec(o.stride()), vec(*padding),
                                 vec(o.dilation()));
}

at::Tensor relu_avg_pool2x2(const at::Tensor& x) {
  const bool fused = x.device().is_cpu() && x.dim() == 4 && x.scalar_type() == at::kFloat &&
                     x.is_contiguous(at::MemoryFormat::ChannelsLast) && x.size(2) >= 2 &&
                     x.size(3) >= 2 && !at::autocast::is_autocast_enabled(at::kCPU);
  if (!fused) return F::avg_pool2d(torch::relu(x), F::AvgPool2dFuncOptions(2));
  return ReluAvgPoolFunction::apply(x);
}

}  // namespace scaletrain
