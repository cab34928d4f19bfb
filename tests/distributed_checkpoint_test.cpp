// DCP folders written by ranks (threads, tests/support/ranks.h) and read back at other layouts,
// bit for bit (a load is a copy); the errors of a save whose boxes are wrong, and of a damaged
// folder. tests/dcp_interop_test.cpp checks the same folders against Python's PyTorch.

#include "scaletrain/distributed_checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "scaletrain/error.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// torch.chunk's split of n into `parts`: pieces of ceil(n / parts), the last ones shorter or
// empty; rank r's piece as a box along dimension `dim` of `shape`.
Box piece(const std::vector<int64_t>& shape, int64_t dim, int parts, int r) {
  const int64_t n = shape[static_cast<size_t>(dim)], c = (n + parts - 1) / parts;
  Box b = whole(shape);
  b.offsets[static_cast<size_t>(dim)] = c * r;
  b.sizes[static_cast<size_t>(dim)] = c;
  return clip(b, shape);
}

at::Tensor part(const at::Tensor& full, const Box& b) {
  at::Tensor t = full;
  for (size_t d = 0; d < b.offsets.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  return t;
}

TensorBox box_of(const std::string& name, const at::Tensor& full, const Box& b) {
  return {{name, {}}, part(full, b).clone(), full.sizes().vec(), b.offsets};
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Tensors of several dtypes and shapes, saved by 4 ranks as ZeRO-style flat shards and tensor-
// parallel rows, read back by 3 ranks as columns and by one whole: every element, bit for bit.
TEST(DistributedCheckpoint, SavedByFourRanksReadByThreeAndWhole) {
  testing::TempDir tmp("dcp_layouts");
  const std::string dir = (tmp.path / "step-10").string();
  torch::manual_seed(1);
  const std::map<std::string, at::Tensor> full = {
      {"w", at::randn({7, 9})},
      {"h", at::randn({5, 3}).to(at::kBFloat16)},
      {"ids", at::randint(-1000, 1000, {11}, at::kLong)},
      {"mask", at::rand({6}) > 0.5},
      {"step", at::scalar_tensor(12.0)},
      {"empty", at::zeros({0, 4})}};
  auto errors = testing::run_ranks(4, [&](Dist& d) {
    DcpState s;
    s.tensors.push_back(box_of("w", full.at("w"), piece({7, 9}, 0, 4, d.rank())));  // rows
    s.tensors.push_back(box_of("h", full.at("h"), piece({5, 3}, 0, 4, d.rank())));  // 2,2,1,0
    s.tensors.push_back(box_of("ids", full.at("ids"), piece({11}, 0, 4, d.rank())));
    s.tensors.push_back(box_of("mask", full.at("mask"), piece({6}, 0, 4, d.rank())));
    s.tensors.push_back(box_of("step", full.at("step"), whole({})));  // every rank: written once
    s.tensors.push_back(box_of("empty", full.at("empty"), whole({0, 4})));
    save_distributed_checkpoint(dir, s, d);
  });
  ASSERT_EQ(errors, std::vector<std::string>(4, ""));
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp",
                                                     "__2_0.distcp", "__3_0.distcp"}));
  EXPECT_EQ(names_in(tmp.path), std::vector<std::string>{"step-10"});  // no temporary left
  const DcpContents c = read_distributed_checkpoint_contents(dir);
  EXPECT_EQ(c.tensors.at("w").chunks.size(), 4u);
  EXPECT_EQ(c.tensors.at("h").chunks.size(), 3u);  // rank 3's empty piece is not a chunk
  EXPECT_EQ(c.tensors.at("step").chunks.size(), 1u);
  EXPECT_EQ(c.tensors.at("h").dtype, at::kBFloat16);

  for (int r = 0; r < 3; ++r) {  // columns (dimension 1) over 3, 1-D tensors in 3 pieces
    std::vector<TensorBox> want;
    for (const auto& [name, t] : full) {
      const Box b = t.dim() == 0 ? whole({}) : piece(t.sizes().vec(), t.dim() - 1, 3, r);
      want.push_back({{name, {}}, at::full(b.sizes, 7, t.options()), t.sizes().vec(), b.offsets});
    }
    load_distributed_checkpoint(dir, want);
    for (const auto& b : want) {
      const Box where{b.offsets, b.tensor.sizes().vec()};
      EXPECT_TRUE(at::equal(b.tensor, part(full.at(b.key.name), where))) << b.key.name << r;
    }
  }
  const auto all = load_distributed_checkpoint_tensors(dir);
  ASSERT_EQ(all.size(), full.size());
  for (const auto& [name, t] : full) EXPECT_TRUE(at::equal(all.at(name), t)) << name;
  // Another dtype converts as copy_ does: bf16 -> float32 is exact.
  std::vector<TensorBox> wide = {{{"h", {}}, at::empty({5, 3}), {5, 3}, {}}};
  load_distributed_checkpoint(dir, wide);
  EXPECT_TRUE(at::equal(wide[0].tensor, full.at("h").to(at::kFloat)));
}

TEST(DistributedCheckpoint, ValuesRoundTripFromRankZero) {
  testing::TempDir tmp("dcp_values");
  const std::string dir = (tmp.path / "c").string();
  const DcpValue betas = DcpValue::tuple({DcpValue::of(0.9), DcpValue::of(0.999)});
  const DcpValue params = DcpValue::list({DcpValue::of(std::string("fc.weight")), DcpValue{}});
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    DcpState s;
    s.values = {{dcp_param_group_key(0, "betas"), betas},
                {dcp_param_group_key(0, "params"), params},
                {{"epoch", {}}, DcpValue::of(int64_t{d.rank() == 0 ? 3 : 99})},
                {{"amsgrad", {}}, DcpValue::of(false)}};
    save_distributed_checkpoint(dir, s, d);
  });
  ASSERT_EQ(errors, std::vector<std::string>(2, ""));
  const auto v = load_distributed_checkpoint_values(dir);
  EXPECT_EQ(v.at("optim.param_groups.0.betas"), betas);
  EXPECT_EQ(v.at("optim.param_groups.0.params"), params);
  EXPECT_EQ(v.at("epoch"), DcpValue::of(int64_t{3}));  // rank 0's
  EXPECT_EQ(v.at("amsgrad"), DcpValue::of(false));
}

// Boxes that do not tile a tensor are refused on every rank with one message, and nothing is
// left on disk.
TEST(DistributedCheckpoint, BoxesThatDoNotTileAreUsageErrorsOnEveryRank) {
  testing::TempDir tmp("dcp_tiling");
  const std::string dir = (tmp.path / "c").string();
  const at::Tensor w = at::arange(12.0).reshape({4, 3});
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    DcpState s;  // rank 0 rows 0-2, rank 1 rows 2-3: row 2 twice
    s.tensors.push_back(box_of("w", w, d.rank() == 0 ? Box{{0, 0}, {3, 3}} : Box{{2, 0}, {2, 3}}));
    try {
      save_distributed_checkpoint(dir, s, d);
    } catch (const UsageError& e) {
      throw Error(std::string("usage: ") + e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("usage: cannot save the checkpoint '" + dir +
                           "': tensor 'w' of shape [4, 3]: chunks 0 [0:3, 0:3] and 1 [2:4, 0:3] "
                           "overlap; give each element to one rank's box only"),
            std::string::npos)
      << errors[0];
  auto gaps = testing::run_ranks(2, [&](Dist& d) {
    DcpState s;  // row 3 is nobody's; rank 1's box has a dtype no checkpoint holds
    s.tensors.push_back(box_of("w", w, Box{{0, 0}, {3, 3}}));
    if (d.rank() == 1) s.tensors[0].tensor = at::zeros({3, 3}, at::kComplexFloat);
    save_distributed_checkpoint(dir, s, d);
  });
  EXPECT_NE(gaps[0].find("rank 1: the box of 'w' has dtype ComplexFloat"), std::string::npos)
      << gaps[0];
  EXPECT_EQ(gaps[0], gaps[1]);
  EXPECT_TRUE(names_in(tmp.path).empty());
  const std::string hole = message_of([&] {
    DcpState s;
    s.tensors.push_back(box_of("w", w, Box{{0, 0}, {3, 3}}));
    save_distributed_checkpoint(dir, s, Dist{});
  });
  EXPECT_NE(hole.find("element [3, 0] of [0:4, 0:3] is in no rank's box"), std::string::npos)
      << hole;
}

TEST(DistributedCheckpoint, AnExistingFolderIsKeptUnlessReplaced) {
  testing::TempDir tmp("dcp_replace");
  const std::string dir = (tmp.path / "c").string();
  auto save = [&](double v, bool replace) {
    DcpState s;
    s.tensors.push_back({{"x", {}}, at::full({3}, v), {3}, {}});
    DcpSaveOptions o;
    o.replace = replace;
    save_distributed_checkpoint(dir, s, Dist{}, o);
  };
  save(1, false);
  EXPECT_NE(message_of([&] { save(2, false); }).find("exists already; save to a new folder"),
            std::string::npos);
  EXPECT_TRUE(at::equal(load_distributed_checkpoint_tensors(dir).at("x"), at::full({3}, 1.0)));
  save(2, true);
  EXPECT_TRUE(at::equal(load_distributed_checkpoint_tensors(dir).at("x"), at::full({3}, 2.0)));
  EXPECT_EQ(names_in(tmp.path), std::vector<std::string>{"c"});
}

void truncate_by(const fs::path& p, uintmax_t n) { fs::resize_file(p, fs::file_size(p) - n); }

TEST(DistributedCheckpoint, DamagedFoldersAreErrorsNamingTheFile) {
  testing::TempDir tmp("dcp_damage");
  const std::string dir = (tmp.path / "c").string();
  DcpState s;
  s.tensors.push_back({{"x", {}}, at::arange(100.0), {100}, {}});
  s.tensors.push_back({{"y", {}}, at::arange(10.0), {10}, {}});
  save_distributed_checkpoint(dir, s, Dist{});
  const fs::path meta = fs::path(dir) / ".metadata", data = fs::path(dir) / "__0_0.distcp";
  const auto meta_bytes = fs::file_size(meta);

  truncate_by(data, 100);  // the last item, y's, loses its end
  EXPECT_NE(message_of([&] {
              load_distributed_checkpoint_tensors(dir);
            }).find("'" + data.string() + "' is truncated: the chunk [0:10] of 'y' lies at bytes"),
            std::string::npos);
  std::fstream(data, std::ios::in | std::ios::out | std::ios::binary).seekp(0).write("XXXX", 4);
  const std::string zip = message_of([&] { load_distributed_checkpoint_tensors(dir, "x"); });
  EXPECT_NE(zip.find("cannot read the chunk [0:100] of 'x' in '" + data.string() + "' (bytes 0+"),
            std::string::npos)
      << zip;

  truncate_by(meta, meta_bytes / 2);
  const std::string half = message_of([&] { read_distributed_checkpoint_contents(dir); });
  EXPECT_NE(half.find("cannot read DCP metadata '" + meta.string() + "': "), std::string::npos)
      << half;
  EXPECT_NE(half.find("truncated"), std::string::npos) << half;
  fs::remove(meta);
  EXPECT_NE(message_of([&] {
              read_distributed_checkpoint_contents(dir);
            }).find("'" + dir + "' holds no readable .metadata"),
            std::string::npos);
}

TEST(DistributedCheckpoint, MissingKeysAndOtherShapesAreNamed) {
  testing::TempDir tmp("dcp_keys");
  const std::string dir = (tmp.path / "c").string();
  DcpState s;
  s.tensors.push_back({{"x", {}}, at::zeros({4, 2}), {4, 2}, {}});
  save_distributed_checkpoint(dir, s, Dist{});
  std::vector<TensorBox> want = {{{"x", {}}, at::zeros({4, 3}), {4, 3}, {}},
                                 {{"z", {}}, at::zeros({1}), {1}, {}}};
  EXPECT_NE(message_of([&] {
              load_distributed_checkpoint(dir, want);
            }).find("missing keys: z; other global shapes: x (saved [4, 2], wanted [4, 3]);"),
            std::string::npos);
}

}  // namespace
}  // namespace scaletrain
