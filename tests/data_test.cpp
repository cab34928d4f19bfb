#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "support/temp_dir.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// Writes an IDX file of unsigned bytes, gzip-compressed; `cut` drops that many trailing bytes.
void write_idx(const fs::path& p, const std::vector<int32_t>& dims,
               const std::vector<uint8_t>& data, size_t cut = 0) {
  std::string bytes = {0, 0, 0x08, static_cast<char>(dims.size())};
  for (int32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) bytes += static_cast<char>((d >> shift) & 0xff);
  }
  bytes.append(data.begin(), data.end());
  bytes.resize(bytes.size() - cut);
  gzFile f = gzopen(p.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

TEST(Data, ReadsIdxFiles) {
  testing::TempDir dir("data");
  write_idx(dir.path / "x.gz", {2, 2, 3}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255});
  auto t = read_idx((dir.path / "x.gz").string());
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(t[1][1][2].item<uint8_t>(), 255);
}

TEST(Data, LoadsASmallFashionMnistFolder) {
  testing::TempDir dir("data");
  std::vector<uint8_t> img(3 * 28 * 28, 0);
  img[28 * 28] = 255;  // image 1's first pixel
  for (auto split : {"train", "t10k"}) {
    write_idx(dir.path / (std::string(split) + "-images-idx3-ubyte.gz"), {3, 28, 28}, img);
    write_idx(dir.path / (std::string(split) + "-labels-idx1-ubyte.gz"), {3}, {7, 0, 9});
  }
  Dataset d = load_fashion_mnist(dir.path.string(), true);
  EXPECT_EQ(d.inputs.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(d.targets[2].item<int64_t>(), 9);
  // (x/255 − 0.2860)/0.3530 in float: the two constants and the three operations round once each
  // (Note [Tolerances]).
  EXPECT_TRUE(testing::within_rounding(d.inputs[1][0][0][0], (1.0 - 0.2860) / 0.3530,
                                       (1.0 + 0.2860) / 0.3530, 5));
  EXPECT_TRUE(testing::within_rounding(d.inputs[0][0][0][0], -0.2860 / 0.3530, 0.2860 / 0.3530, 5));
}

TEST(Data, TruncatedFileIsNamed) {
  testing::TempDir dir("data");
  auto p = dir.path / "bad.gz";
  write_idx(p, {4}, {1, 2, 3, 4}, 2);
  try {
    read_idx(p.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected 4 data bytes, found 2"), std::string::npos)
        << e.what();
  }
}

TEST(Data, MissingFileSaysWhatToInstall) {
  try {
    load_fashion_mnist("/no/such/folder", true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/folder/train-images-idx3-ubyte.gz"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos);
  }
}

TEST(Data, RealFashionMnistFromDebian) {
  if (!fs::exists(std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  Dataset test = load_fashion_mnist(kFashionMnistDir, false);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(test.targets.min().item<int64_t>(), 0);
  EXPECT_EQ(test.targets.max().item<int64_t>(), 9);
  EXPECT_EQ(at::bincount(test.targets)[3].item<int64_t>(), 1000);  // balanced classes
}

TEST(Data, SyntheticIsDeterministicPerSeed) {
  auto a = make_synthetic(8, 3, 4, 4, 5, 1), b = make_synthetic(8, 3, 4, 4, 5, 1);
  EXPECT_TRUE(at::equal(a.inputs, b.inputs));
  EXPECT_TRUE(at::equal(a.targets, b.targets));
  EXPECT_LT(a.targets.max().item<int64_t>(), 5);
  auto [x, y] = gather_batch(a, {7, 0});
  EXPECT_TRUE(at::equal(x[0], a.inputs[7]));
}

}  // namespace
}  // namespace scaletrain
