#include "scaletrain/loader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stb/stb_image_write.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::shared_ptr<Dataset> counting_dataset(int64_t n) {
  auto d = std::make_shared<Dataset>();
  d->inputs = at::arange(n, at::kFloat).view({n, 1, 1, 1});
  d->targets = at::arange(n, at::kLong);
  d->num_classes = n;
  return d;
}

LoaderOptions opts(int64_t batch_size, int workers = 1, uint64_t seed = 0) {
  LoaderOptions o;
  o.batch_size = batch_size;
  o.workers = workers;
  o.seed = seed;
  return o;
}

std::vector<int64_t> shuffled(int64_t n) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < n; ++i) idx.push_back((i * 7) % n);  // 7 and n coprime
  return idx;
}

TEST(Loader, BatchesComeInOrderWithTheirRows) {
  auto d = counting_dataset(10);
  const auto idx = shuffled(10);
  for (int workers : {0, 1, 3}) {
    SCOPED_TRACE(workers);
    Loader loader(batches_of(d), idx, opts(3, workers));
    EXPECT_EQ(loader.num_batches(), 4);
    size_t seen = 0;
    int64_t expected_index = 0;
    while (auto b = loader.next()) {
      EXPECT_EQ(b->index, expected_index++);
      for (int64_t r = 0; r < b->targets.size(0); ++r) {
        EXPECT_EQ(b->targets[r].item<int64_t>(), idx[seen]);
        EXPECT_EQ(b->inputs[r].item<float>(), static_cast<float>(idx[seen]));
        ++seen;
      }
    }
    EXPECT_EQ(seen, idx.size());
    EXPECT_FALSE(loader.next().has_value());
  }
}

TEST(Loader, DropLastDropsTheShortBatch) {
  auto o = opts(3);
  o.drop_last = true;
  Loader loader(batches_of(counting_dataset(10)), shuffled(10), o);
  int n = 0;
  while (auto b = loader.next()) {
    EXPECT_EQ(b->targets.size(0), 3);
    ++n;
  }
  EXPECT_EQ(n, 3);
}

// The seed a batch sees depends on (loader seed, batch number) only: the same with any number
// of workers, different between batches and between loader seeds.
TEST(Loader, AugmentationSeedsAreRepeatable) {
  BatchFn seed_of = [](const std::vector<int64_t>& idx, uint64_t seed) {
    return Batch{at::tensor({static_cast<int64_t>(seed >> 1)}), at::tensor(idx, at::kLong), 0};
  };
  auto seeds = [&](int workers, uint64_t loader_seed) {
    Loader loader(seed_of, shuffled(20), opts(4, workers, loader_seed));
    std::vector<int64_t> out;
    while (auto b = loader.next()) out.push_back(b->inputs.item<int64_t>());
    return out;
  };
  const auto a = seeds(0, 5);
  EXPECT_EQ(a, seeds(2, 5));
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), a.size());
  EXPECT_NE(a, seeds(2, 6));
}

TEST(Loader, WorkersStayWithinThePrefetchWindow) {
  std::atomic<int> built{0};
  BatchFn count = [&](const std::vector<int64_t>& idx, uint64_t) {
    ++built;
    return Batch{at::zeros({1}), at::tensor(idx, at::kLong), 0};
  };
  auto o = opts(1, 2);
  o.prefetch = 3;
  Loader loader(count, shuffled(100), o);
  // The workers start ahead of the consumer (waiting up to 10 s for a busy machine's
  // scheduler), then stop at prefetch x workers = 6 batches.
  for (int i = 0; i < 1000 && built.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(built.load(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_LE(built.load(), 6);
  loader.next();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LE(built.load(), 7);
}

TEST(Loader, WorkerErrorIsRaisedByNext) {
  BatchFn fail_at_2 = [](const std::vector<int64_t>& idx, uint64_t) {
    if (idx[0] == 2) throw Error("bad sample 2");
    return Batch{at::zeros({1}), at::tensor(idx, at::kLong), 0};
  };
  Loader loader(fail_at_2, {0, 1, 2, 3, 4}, opts(1, 1));
  EXPECT_TRUE(loader.next().has_value());
  EXPECT_TRUE(loader.next().has_value());
  try {
    loader.next();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad sample 2"), std::string::npos);
  }
}

TEST(Loader, BadOptionsAreRefused) {
  EXPECT_THROW(Loader(batches_of(counting_dataset(4)), {0}, opts(0)), UsageError);
  EXPECT_THROW(Loader(batches_of(counting_dataset(4)), {0}, opts(1, -1)), UsageError);
}

// A tiny ImageNet-style folder: cat/ and dog/, PNG and JPEG, colour and grey.
struct Folder {
  fs::path root = fs::temp_directory_path() / ("scaletrain_images_" + std::to_string(getpid()));
  Folder() {
    fs::create_directories(root / "dog");
    fs::create_directories(root / "cat");
    fs::create_directories(root / "empty-is-fine");
    // 40x40, left half red, right half blue.
    std::vector<unsigned char> rgb(40 * 40 * 3, 0);
    for (int y = 0; y < 40; ++y) {
      for (int x = 0; x < 40; ++x)
        rgb[static_cast<size_t>((y * 40 + x) * 3 + (x < 20 ? 0 : 2))] = 255;
    }
    stbi_write_png((root / "cat" / "a.png").c_str(), 40, 40, 3, rgb.data(), 40 * 3);
    std::vector<unsigned char> grey(30 * 50, 128);  // 50 wide, 30 high
    stbi_write_png((root / "cat" / "b.PNG").c_str(), 50, 30, 1, grey.data(), 50);
    stbi_write_jpg((root / "dog" / "c.jpg").c_str(), 40, 40, 3, rgb.data(), 95);
    std::ofstream(root / "dog" / "notes.txt") << "not an image";
  }
  ~Folder() { fs::remove_all(root); }
};

TEST(ImageFolder, ScansClassesLikeTorchvision) {
  Folder f;
  ImageFolder folder(f.root);
  EXPECT_EQ(folder.classes(), (std::vector<std::string>{"cat", "dog", "empty-is-fine"}));
  ASSERT_EQ(folder.size(), 3);
  EXPECT_EQ(folder.label_of(0), 0);
  EXPECT_EQ(folder.label_of(2), 1);
  EXPECT_EQ(folder.path_of(2).filename(), "c.jpg");
}

TEST(ImageFolder, TrainTransformIsRandomButRepeatable) {
  Folder f;
  ImageFolderOptions o;
  o.size = 24;
  ImageFolder folder(f.root, o);
  auto a = folder.image(0, 1);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{3, 24, 24}));
  EXPECT_TRUE(at::equal(a, folder.image(0, 1)));
  bool differs = false;
  for (uint64_t seed = 2; seed < 10 && !differs; ++seed)
    differs = !at::equal(a, folder.image(0, seed));
  EXPECT_TRUE(differs);
  // Grey images become three equal channels.
  // Normalised with each channel's mean and std in float (the two constants, the subtraction and
  // the division round once each) and undone here in double: both channels give the same pixel.
  auto g = folder.image(1, 3).to(at::kDouble);
  auto red = g[0] * 0.229 + 0.485, green = g[1] * 0.224 + 0.456;
  EXPECT_TRUE(testing::within_rounding(red, green, green.abs() * 2 + 0.485 + 0.456, 5));
}

TEST(ImageFolder, FlipAndNormaliseAreExact) {
  Folder f;
  ImageFolderOptions o;
  o.size = 40;
  o.scale = {1, 1};  // the whole image, at its own size: no resampling
  o.ratio = {1, 1};
  o.mean = {0.5, 0.5, 0.5};
  o.std = {0.5, 0.5, 0.5};
  for (double flip : {0.0, 1.0}) {
    o.flip = flip;
    auto img = ImageFolder(f.root, o).image(0, 7);
    const float left_red = img[0][10][5].item<float>();
    const float left_blue = img[2][10][5].item<float>();
    EXPECT_EQ(left_red, flip == 0 ? 1.0f : -1.0f);  // (1 - 0.5) / 0.5 and (0 - 0.5) / 0.5
    EXPECT_EQ(left_blue, flip == 0 ? -1.0f : 1.0f);
  }
}

TEST(ImageFolder, EvalResizesTheShortSideAndCropsTheCentre) {
  Folder f;
  ImageFolderOptions o;
  o.train = false;
  o.resize = 20;
  o.size = 16;
  ImageFolder folder(f.root, o);
  auto g = folder.image(1, 0);  // 50x30 grey -> 33x20 -> centre 16x16
  EXPECT_EQ(g.sizes(), (std::vector<int64_t>{3, 16, 16}));
  // A constant image stays constant through the antialiased resize: each pixel is a weighted sum
  // of at most 4 x 4 taps whose weights are normalised in float (2 x 8 terms), then /255 and the
  // normalisation (5 roundings).
  const double expected = (128.0 / 255 - 0.485) / 0.229;
  EXPECT_TRUE(testing::within_rounding(g[0], expected, (128.0 / 255 + 0.485) / 0.229, 21));
  // Eval is deterministic whatever the seed.
  EXPECT_TRUE(at::equal(folder.image(0, 1), folder.image(0, 2)));
}

TEST(ImageFolder, LoaderThreadsGiveTheSameBatches) {
  Folder f;
  ImageFolderOptions o;
  o.size = 16;
  auto folder = std::make_shared<ImageFolder>(f.root, o);
  auto all = [&](int workers) {
    Loader loader(batches_of(folder), {2, 0, 1}, opts(2, workers, 3));
    std::vector<at::Tensor> out;
    while (auto b = loader.next()) {
      out.push_back(b->inputs);
      out.push_back(b->targets);
    }
    return out;
  };
  auto a = all(0), b = all(2);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a[0].sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  EXPECT_TRUE(at::equal(a[1], at::tensor({1, 0}, at::kLong)));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i]));
}

TEST(ImageFolder, ErrorsNameThePath) {
  Folder f;
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { ImageFolder(f.root / "nope"); }).find("nope"), std::string::npos);
  fs::create_directories(f.root / "flat");
  std::ofstream(f.root / "flat" / "x.png") << "x";
  EXPECT_NE(message([&] { ImageFolder(f.root / "flat"); }).find("no class sub-folders"),
            std::string::npos);
  fs::create_directories(f.root / "noimg" / "a");
  EXPECT_NE(message([&] { ImageFolder(f.root / "noimg"); }).find("no image"), std::string::npos);
  std::ofstream(f.root / "cat" / "broken.jpg") << "definitely not a jpeg";
  ImageFolder folder(f.root);
  int64_t broken = -1;
  for (int64_t i = 0; i < folder.size(); ++i) {
    if (folder.path_of(i).filename() == "broken.jpg") broken = i;
  }
  ASSERT_GE(broken, 0);
  EXPECT_NE(message([&] { folder.image(broken, 0); }).find("broken.jpg"), std::string::npos);
}

}  // namespace
}  // namespace scaletrain
