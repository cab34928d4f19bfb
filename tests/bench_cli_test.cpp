// `scaletrain bench` end to end on its fast suites (transformer: both sides, C++ and its Python
// peer, at a tiny size): raw CSV, JSON statistics, a valid PNG and a report section naming the
// machine and the command.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "support/subprocess.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

class BenchCli : public ::testing::TestWithParam<std::string> {};

TEST_P(BenchCli, WritesCsvJsonPngAndReport) {
  const fs::path out =
      fs::temp_directory_path() / ("scaletrain_bench_" + GetParam() + std::to_string(getpid()));
  fs::remove_all(out);
  auto r = testing::run_command(testing::cli_path() + " bench " + GetParam() +
                                    " --quick --repeats 1 --out " + out.string() + " 2>&1",
                                300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string csv = slurp(out / (GetParam() + ".csv"));
  EXPECT_GT(std::count(csv.begin(), csv.end(), '\n'), 3) << csv;
  EXPECT_NE(slurp(out / (GetParam() + ".json")).find("\"mean\""), std::string::npos);
  if (testing::have_gnuplot()) {
    const std::string png = slurp(out / (GetParam() + ".png"));
    ASSERT_GT(png.size(), 1000u);
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  } else {  // a machine without gnuplot gets the script that draws it
    EXPECT_TRUE(fs::exists(out / (GetParam() + ".gp")));
  }
  const std::string report = slurp(out / "report.md");
  EXPECT_NE(report.find("scaletrain bench " + GetParam() + " --quick"), std::string::npos)
      << report;
  EXPECT_NE(report.find("cores"), std::string::npos) << report;
  fs::remove_all(out);
}

INSTANTIATE_TEST_SUITE_P(Suites, BenchCli,
                         ::testing::Values("pipeline-memory", "loader", "pipeline-ranks",
                                           "transformer", "checkpoint", "transformer-memory",
                                           "resilience", "context", "experts"));

}  // namespace
}  // namespace scaletrain
