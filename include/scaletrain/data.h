#pragma once
// Data sets held in memory as two tensors: inputs (images [N, C, H, W], float, normalised) and
// targets (classes [N], int64).
//
// Fashion-MNIST is read straight from the IDX .gz files that Debian's dataset-fashion-mnist
// installs (/usr/share/datasets/fashion-mnist): train-images-idx3-ubyte.gz,
// train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz. A missing,
// truncated or malformed file is an Error naming it.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace scaletrain {

struct Dataset {
  at::Tensor inputs;   // images: float32 [N, C, H, W]; tokens: int64 [N, T]
  at::Tensor targets;  // classes: int64 [N]; next tokens: int64 [N, T]
  int64_t num_classes = 0;
  int64_t size() const { return targets.defined() ? targets.size(0) : 0; }
};

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// The train (60,000) or test (10,000) split, scaled to [0, 1] then normalised with the
/// data set's mean 0.2860 and std 0.3530.
Dataset load_fashion_mnist(const std::string& dir, bool train);

/// Reads one IDX file (gzip-compressed or not) into a uint8 tensor of its dimensions.
at::Tensor read_idx(const std::string& path);

/// Random images and classes, as the seeds make them (torch.randn images, random classes).
Dataset make_synthetic(int64_t n, int64_t channels, int64_t height, int64_t width,
                       int64_t num_classes, uint64_t seed);

/// Rows `indices` of a data set, as one batch.
std::pair<at::Tensor, at::Tensor> gather_batch(const Dataset& d,
                                               const std::vector<int64_t>& indices);

}  // namespace scaletrain
