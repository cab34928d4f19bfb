#include <ATen/ATen.h>
#include <zlib.h>

#include <filesystem>
#include <memory>

#include "scaletrain/data.h"
#include "scaletrain/error.h"

namespace scaletrain {

at::Tensor read_idx(const std::string& path) {
  if (!std::filesystem::exists(path)) {
    throw UsageError("data file '" + path +
                     "' does not exist; install Debian's dataset-fashion-mnist "
                     "or point --data-dir at a folder holding the IDX files");
  }
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), gzclose);
  if (!f) throw Error("cannot open data file '" + path + "'");
  std::string bytes;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f.get(), buf, sizeof(buf))) > 0) bytes.append(buf, static_cast<size_t>(n));
  if (n < 0) throw Error("data file '" + path + "' is corrupt (gzip error)");
  auto bad = [&](const std::string& why) {
    return Error("data file '" + path + "' is not a valid IDX file: " + why);
  };
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0) throw bad("bad magic number");
  if (static_cast<uint8_t>(bytes[2]) != 0x08) throw bad("only unsigned-byte data is supported");
  const int dims = static_cast<uint8_t>(bytes[3]);
  if (dims < 1 || bytes.size() < 4 + 4 * static_cast<size_t>(dims)) throw bad("truncated header");
  std::vector<int64_t> shape;
  size_t expected = 1;
  for (int i = 0; i < dims; ++i) {
    auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + 4 + 4 * i);
    int64_t d = (int64_t{p[0]} << 24) | (int64_t{p[1]} << 16) | (int64_t{p[2]} << 8) | p[3];
    shape.push_back(d);
    expected *= static_cast<size_t>(d);
  }
  const size_t offset = 4 + 4 * static_cast<size_t>(dims);
  if (bytes.size() - offset != expected) {
    throw bad("expected " + std::to_string(expected) + " data bytes, found " +
              std::to_string(bytes.size() - offset) + " (truncated?)");
  }
  auto t = at::empty(shape, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data() + offset, expected);
  return t;
}

Dataset load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  auto images = read_idx(prefix + "-images-idx3-ubyte.gz");
  auto labels = read_idx(prefix + "-labels-idx1-ubyte.gz");
  if (images.dim() != 3 || labels.dim() != 1 || images.size(0) != labels.size(0)) {
    throw Error("Fashion-MNIST files under '" + dir +
                "' disagree: " + std::to_string(images.size(0)) + " images but " +
                std::to_string(labels.size(0)) + " labels");
  }
  Dataset d;
  d.inputs = images.unsqueeze(1).to(at::kFloat).div_(255).sub_(0.2860).div_(0.3530);
  d.targets = labels.to(at::kLong);
  d.num_classes = 10;
  return d;
}

Dataset make_synthetic(int64_t n, int64_t c, int64_t h, int64_t w, int64_t classes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Dataset d;
  d.inputs = at::randn({n, c, h, w}, gen);
  d.targets = at::randint(classes, {n}, gen, at::kLong);
  d.num_classes = classes;
  return d;
}

std::pair<at::Tensor, at::Tensor> gather_batch(const Dataset& d,
                                               const std::vector<int64_t>& indices) {
  auto idx = at::tensor(indices, at::kLong);
  return {d.inputs.index_select(0, idx), d.targets.index_select(0, idx)};
}

}  // namespace scaletrain
