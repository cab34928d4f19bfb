#include "scaletrain/image_folder.h"

#include <ATen/ATen.h>
#include <stb/stb_image.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "scaletrain/error.h"

namespace scaletrain {

namespace fs = std::filesystem;

namespace {

bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* e : {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tga", ".ppm", ".pgm"}) {
    if (ext == e) return true;
  }
  return false;
}

// A crop box: top, left, height, width.
struct CropBox {
  int64_t top, left, h, w;
};

// torchvision's RandomResizedCrop.get_params: ten tries at a random area and aspect ratio, then
// the centre crop of the whole image with the ratio clamped into range.
CropBox random_resized_box(int64_t H, int64_t W, const ImageFolderOptions& o,
                           std::mt19937_64& rng) {
  const double area = static_cast<double>(H * W);
  std::uniform_real_distribution<double> scale(o.scale.first, o.scale.second);
  std::uniform_real_distribution<double> log_ratio(std::log(o.ratio.first),
                                                   std::log(o.ratio.second));
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * scale(rng);
    const double aspect = std::exp(log_ratio(rng));
    const auto w = static_cast<int64_t>(std::lround(std::sqrt(target * aspect)));
    const auto h = static_cast<int64_t>(std::lround(std::sqrt(target / aspect)));
    if (w > 0 && h > 0 && w <= W && h <= H) {
      const int64_t top = std::uniform_int_distribution<int64_t>(0, H - h)(rng);
      const int64_t left = std::uniform_int_distribution<int64_t>(0, W - w)(rng);
      return {top, left, h, w};
    }
  }
  const double in_ratio = static_cast<double>(W) / static_cast<double>(H);
  int64_t w = W, h = H;
  if (in_ratio < o.ratio.first) {
    h = static_cast<int64_t>(std::lround(static_cast<double>(W) / o.ratio.first));
  } else if (in_ratio > o.ratio.second) {
    w = static_cast<int64_t>(std::lround(static_cast<double>(H) * o.ratio.second));
  }
  return {(H - h) / 2, (W - w) / 2, h, w};
}

at::Tensor resize(const at::Tensor& chw, int64_t h, int64_t w) {
  if (chw.size(1) == h && chw.size(2) == w) return chw;
  return at::_upsample_bilinear2d_aa(chw.unsqueeze(0), {h, w}, false).squeeze(0);
}

}  // namespace

ImageFolder::ImageFolder(const fs::path& root, ImageFolderOptions o) : o_(std::move(o)) {
  if (!fs::is_directory(root)) {
    throw Error("image folder '" + root.string() +
                "' does not exist or is not a folder; give the folder that holds one "
                "sub-folder per class");
  }
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    if (e.is_directory()) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  if (dirs.empty()) {
    throw Error("image folder '" + root.string() +
                "' has no class sub-folders; put each class's images in a folder of its own");
  }
  for (const auto& dir : dirs) {
    const auto label = static_cast<int64_t>(classes_.size());
    classes_.push_back(dir.filename().string());
    std::vector<fs::path> files;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (e.is_regular_file() && is_image(e.path())) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (auto& f : files) samples_.emplace_back(std::move(f), label);
  }
  if (samples_.empty()) {
    throw Error("image folder '" + root.string() + "' has " + std::to_string(classes_.size()) +
                " class folder(s) but no image (.jpg, .jpeg, .png, .bmp, .gif, .tga, .ppm, .pgm)");
  }
  if (o_.mean.size() != 3 || o_.std.size() != 3) {
    throw UsageError("image folder normalisation needs 3 means and 3 standard deviations");
  }
}

const fs::path& ImageFolder::path_of(int64_t i) const {
  return samples_.at(static_cast<size_t>(i)).first;
}
int64_t ImageFolder::label_of(int64_t i) const {
  return samples_.at(static_cast<size_t>(i)).second;
}

at::Tensor ImageFolder::image(int64_t index, uint64_t seed) const {
  const fs::path& path = path_of(index);
  int w = 0, h = 0, channels = 0;
  std::unique_ptr<unsigned char, void (*)(void*)> pixels(
      stbi_load(path.c_str(), &w, &h, &channels, 3), stbi_image_free);
  if (!pixels) {
    throw Error("cannot decode image '" + path.string() + "': " + stbi_failure_reason() +
                "; remove or replace the file");
  }
  // HWC uint8 -> CHW float in [0, 1], as ToTensor.
  auto img =
      at::from_blob(pixels.get(), {h, w, 3}, at::kByte).permute({2, 0, 1}).to(at::kFloat).div_(255);
  std::mt19937_64 rng(seed);
  if (o_.train) {
    CropBox b = random_resized_box(h, w, o_, rng);
    img = resize(img.slice(1, b.top, b.top + b.h).slice(2, b.left, b.left + b.w), o_.size, o_.size);
    if (std::uniform_real_distribution<double>(0, 1)(rng) < o_.flip) img = img.flip({2});
  } else {
    const int64_t short_side = std::min(h, w);
    const int64_t nh = h == short_side ? o_.resize : o_.resize * h / short_side;
    const int64_t nw = w == short_side ? o_.resize : o_.resize * w / short_side;
    img = resize(img, nh, nw);
    if (nh < o_.size || nw < o_.size) img = resize(img, o_.size, o_.size);
    const auto top =
        static_cast<int64_t>(std::lround(static_cast<double>(img.size(1) - o_.size) / 2));
    const auto left =
        static_cast<int64_t>(std::lround(static_cast<double>(img.size(2) - o_.size) / 2));
    img = img.slice(1, top, top + o_.size).slice(2, left, left + o_.size);
  }
  auto mean = at::tensor(std::vector<float>(o_.mean.begin(), o_.mean.end())).view({3, 1, 1});
  auto stdev = at::tensor(std::vector<float>(o_.std.begin(), o_.std.end())).view({3, 1, 1});
  return img.sub(mean).div_(stdev).contiguous();
}

std::pair<at::Tensor, at::Tensor> ImageFolder::batch(const std::vector<int64_t>& indices,
                                                     uint64_t seed) const {
  std::vector<at::Tensor> images;
  std::vector<int64_t> labels;
  images.reserve(indices.size());
  for (size_t i = 0; i < indices.size(); ++i) {
    images.push_back(image(indices[i], seed + i));
    labels.push_back(label_of(indices[i]));
  }
  return {at::stack(images), at::tensor(labels, at::kLong)};
}

}  // namespace scaletrain
