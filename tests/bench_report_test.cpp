#include "scaletrain/bench.h"
#include "support/rounding.h"
#include "support/subprocess.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace scaletrain::bench {
namespace {

namespace fs = std::filesystem;

TEST(BenchStats, MeanStdMinMax) {
  Stats s = stats({1, 2, 3, 4});
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.std, std::sqrt(1.25));
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 4);
  EXPECT_EQ(s.n, 4u);
  EXPECT_EQ(stats({}).n, 0u);
}

bool is_png(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  char sig[8] = {};
  in.read(sig, 8);
  return std::string(sig, 8) == "\x89PNG\r\n\x1a\n";
}

SuiteResult example(Plot::Kind kind) {
  SuiteResult r;
  r.suite = kind == Plot::Kind::kBars ? "bars" : "lines";
  r.title = "Example";
  r.command = "scaletrain bench example";
  r.unit = "s";
  r.plot = {kind, "Example", "x", "seconds", false, false};
  r.samples = {{"single", "1", 1, {1.0, 1.2, 0.9}},
               {"single", "2", 2, {2.0, 2.1}},
               {"pipelined", "1", 1, {0.7, 0.8}},
               {"pipelined", "2", 2, {1.1, 1.0}}};
  return r;
}

TEST(BenchReport, WritesCsvJsonPngAndMarkdown) {
  if (!testing::have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed (Debian's gnuplot-nox)";
  fs::path dir = fs::temp_directory_path() / ("scaletrain_bench_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (auto kind : {Plot::Kind::kBars, Plot::Kind::kLines}) {
    auto r = example(kind);
    std::string md = write_suite(r, describe_machine("none", "2.11.0"), dir.string());
    // Every repetition is a CSV row, after the header.
    std::ifstream csv(dir / (r.suite + ".csv"));
    std::string line;
    int rows = -1;
    while (std::getline(csv, line)) ++rows;
    EXPECT_EQ(rows, 9);
    auto j = nlohmann::json::parse(std::ifstream(dir / (r.suite + ".json")));
    EXPECT_EQ(j["samples"].size(), 4u);
    // (2.0 + 2.1) / 2: the literal 2.1, the sum and the literal 2.05 each round once.
    EXPECT_NEAR(j["samples"][1]["mean"].get<double>(), 2.05,
                testing::rounding_bound<double>(3, 2.05));
    EXPECT_EQ(j["samples"][0]["n"].get<int>(), 3);
    EXPECT_TRUE(is_png(dir / (r.suite + ".png")));
    EXPECT_GT(fs::file_size(dir / (r.suite + ".png")), 5000u) << "an empty-looking plot";
    EXPECT_NE(md.find("| pipelined | 2 | 1.05 |"), std::string::npos) << md;
    EXPECT_NE(md.find("`scaletrain bench example`"), std::string::npos) << md;
  }
  std::ifstream report(dir / "report.md");
  std::string all((std::istreambuf_iterator<char>(report)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("![Example](bars.png)"), std::string::npos);
  EXPECT_NE(all.find("![Example](lines.png)"), std::string::npos);
  fs::remove_all(dir);
}

// A machine without gnuplot (a GPU node with no package manager) keeps the plot's script and
// data, named relative to the output folder; gnuplot run there later draws the same PNG.
TEST(BenchReport, WithoutGnuplotLeavesAScriptThatDrawsLater) {
  fs::path dir =
      fs::temp_directory_path() / ("scaletrain_bench_nognuplot_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const std::string saved = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
  setenv("PATH", "/nonexistent", 1);
  auto r = example(Plot::Kind::kLines);
  write_suite(r, describe_machine("none", "2.11.0"), dir.string());
  setenv("PATH", saved.c_str(), 1);
  EXPECT_FALSE(fs::exists(dir / "lines.png"));
  ASSERT_TRUE(fs::exists(dir / "lines.gp"));
  ASSERT_TRUE(fs::exists(dir / "lines.png.dat"));
  if (!testing::have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed (Debian's gnuplot-nox)";
  const std::string draw = "cd '" + dir.string() + "' && gnuplot lines.gp";
  ASSERT_EQ(std::system(draw.c_str()), 0);
  EXPECT_TRUE(is_png(dir / "lines.png"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace scaletrain::bench
