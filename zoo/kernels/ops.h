#pragma once
// Faster CPU kernels for two layers of the zoo (internal, not public API): used by LeNet and the
// small-image ResNet-18 in src/models, tested against LibTorch's ops in tests/kernels_test.cpp.

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Conv2d;
}

namespace scaletrain {

/// `conv(x)`, with a faster weight gradient for the convolutions oneDNN handles worst on the CPU:
/// a stem over one-channel images (in_channels 1, kernel height · width ≤ 32), with groups 1 and
/// padding_mode zeros. Their weight gradient
/// runs as one batched matrix product over the unfolded input (im2col) instead of oneDNN's
/// kernel, which reaches 2 GFLOP/s on a 1-channel 3×3 convolution. The forward and the input
/// gradient are LibTorch's; on other devices and other convolutions this is `conv(x)`. Results
/// equal `conv(x)`'s to float rounding (the sum runs in another order). Note [Stem conv] in
/// ops.cpp.
at::Tensor conv2d(torch::nn::Conv2d conv, const at::Tensor& x);

/// conv2d's faster weight gradient taken unconditionally, whatever the channel count (for
/// measuring it; conv2d decides when to take it). Throws UsageError for padding given by name,
/// groups other than 1 or a padding mode other than zeros.
at::Tensor stem_conv2d(torch::nn::Conv2d conv, const at::Tensor& x);

/// The most bytes of unfolded input conv2d's weight gradient holds at once (32 MiB): the batch
/// is unfolded in slices of that size. Settable for tests; one sample is the smallest slice.
int64_t stem_unfold_bytes();
void set_stem_unfold_bytes(int64_t bytes);

/// avg_pool2d(relu(x), 2) (2x2 windows, stride 2), fused into one pass each way for channels-last
/// float tensors on the CPU (Note [Fused ReLU + pool] in ops.cpp); other tensors take LibTorch's
/// two ops. LeNet uses it after each convolution.
at::Tensor relu_avg_pool2x2(const at::Tensor& x);

}  // namespace scaletrain
