#pragma once
// An ImageNet-style image folder, as torchvision's ImageFolder reads it: one sub-folder per
// class (classes sorted by name, numbered from 0), images inside (JPEG, PNG, BMP, GIF, TGA,
// PPM/PGM; decoded with stb_image). Each sample is decoded when asked for, so that loader
// threads (loader.h) do the work in the background.
//
// Transforms, with torchvision's defaults:
//   train  RandomResizedCrop(size, scale (0.08, 1), ratio (3/4, 4/3)), RandomHorizontalFlip(0.5),
//          ToTensor, Normalize(mean, std)
//   eval   Resize(resize) of the shorter side, CenterCrop(size), ToTensor, Normalize(mean, std)
// Resizing is bilinear with antialiasing. Randomness comes from the seed given per sample, so
// augmentation is repeatable.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain {

struct ImageFolderOptions {
  bool train = true;     // random crop and flip; false: resize and centre crop
  int64_t size = 224;    // output height and width
  int64_t resize = 256;  // eval: shorter side before the centre crop
  std::pair<double, double> scale{0.08, 1.0};
  std::pair<double, double> ratio{3.0 / 4.0, 4.0 / 3.0};
  double flip = 0.5;  // probability of a horizontal flip (train)
  std::vector<double> mean{0.485, 0.456, 0.406};
  std::vector<double> std{0.229, 0.224, 0.225};
};

class ImageFolder {
 public:
  /// Scans `root`. Throws Error naming the folder when it is missing, has no class folders,
  /// or holds no image.
  explicit ImageFolder(const std::filesystem::path& root, ImageFolderOptions options = {});

  int64_t size() const { return static_cast<int64_t>(samples_.size()); }
  const std::vector<std::string>& classes() const { return classes_; }
  const std::filesystem::path& path_of(int64_t index) const;
  int64_t label_of(int64_t index) const;

  /// Sample `index`: a float [3, size, size] image and its class. Throws Error naming the file
  /// when it cannot be decoded.
  at::Tensor image(int64_t index, uint64_t seed) const;
  /// Images [N, 3, size, size] and labels [N]; sample i uses seed + i.
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices, uint64_t seed) const;

 private:
  ImageFolderOptions o_;
  std::vector<std::string> classes_;
  std::vector<std::pair<std::filesystem::path, int64_t>> samples_;
};

}  // namespace scaletrain
