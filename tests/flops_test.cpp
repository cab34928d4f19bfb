// Model FLOPs utilisation (flops.h): the GPT's FLOPs per token against a hand computation
// (Note [GPT FLOPs] in models/gpt.h), the measured CPU matmul peak, and the trainer's MFU
// (TrainResult::mfu): achieved = flops per sample × samples/s, against the measured or given
// peak per device times the devices; 0 where the model states no FLOPs.

#include "scaletrain/flops.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "gpt.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

using testing::TempDir;

// ---- The GPT's FLOPs ---------------------------------------------------------------------------

// gpt2-small (C 768, L 12, H 12, Q 64, T 1024, V 50257), by hand:
//   a block: 12·768² + 13·768 = 7,077,888 + 9,984 = 7,087,872; 12 blocks: 85,054,464
//   N = 85,054,464 + ln_f 2·768 + head 50,257·768 = 85,054,464 + 1,536 + 38,597,376 = 123,653,376
//     (nanoGPT prints "number of parameters: 123.65M" for it)
//   6·N = 741,920,256; 12·L·H·Q·T = 12·12·12·64·1024 = 113,246,208
//   per token 855,166,464; per sample (1024 tokens) 875,690,459,136: 0.876 TFLOP
TEST(GptFlops, Gpt2SmallMatchesTheHandComputation) {
  const GPTConfig c = gpt_config("gpt2-small");
  EXPECT_EQ(gpt_flops_parameters(c), 123653376);
  EXPECT_EQ(gpt_flops_per_token(c), 855166464);
  EXPECT_EQ(gpt_flops_per_token(c) * c.block_size, int64_t{875690459136});
}

// gpt-tiny (C 64, L 2, H 4, Q 16, T 64, V 256): N = 2·(12·64² + 13·64) + 128 + 256·64 = 116,480;
// 6·N = 698,880, 12·2·4·16·64 = 98,304: 797,184 per token, 51,019,776 per sample. The zoo's model
// states it.
TEST(GptFlops, TheZoosGptStatesItsFlopsPerSample) {
  EXPECT_EQ(gpt_flops_per_token(gpt_config("gpt-tiny")), 797184);
  EXPECT_EQ(make_model("gpt-tiny").flops_per_sample, 51019776);
  ModelOptions shorter;
  shorter.context = 8;
  shorter.vocab_size = 16;  // N = 99,968 + 128 + 1,024 = 101,120; 606,720 + 12,288 per token
  EXPECT_EQ(make_model("gpt-tiny", shorter).flops_per_sample, 8 * 619008);
  EXPECT_EQ(make_model("lenet").flops_per_sample, 0) << "the other models state none";
}

// N is the built module's parameters but the lookups: wpe always, wte where the head is untied.
TEST(GptFlops, ParametersAreTheModulesButTheEmbeddingLookups) {
  for (bool tied : {true, false}) {
    GPTConfig c = gpt_config("gpt-tiny");
    c.n_layer = 3;
    c.vocab_size = 100;
    c.tied_head = tied;
    GPTImpl m(c);
    const int64_t wpe = c.block_size * c.n_embd, wte = c.vocab_size * c.n_embd;
    EXPECT_EQ(gpt_flops_parameters(c), parameter_count(m) - wpe - (tied ? 0 : wte))
        << "tied " << tied;
  }
}

// ---- The peak and the ratio --------------------------------------------------------------------

TEST(MatmulPeak, IsPositiveAndFinite) {
  const double peak = measure_cpu_matmul_peak();
  EXPECT_GT(peak, 0);
  EXPECT_TRUE(std::isfinite(peak)) << peak;
  MatmulPeakOptions small;
  small.min_size = 16;
  small.max_size = 40;  // 16 and 32
  small.repeats = 1;
  small.budget_s = 0;
  const double tiny = measure_cpu_matmul_peak(small);
  EXPECT_GT(tiny, 0);
  EXPECT_TRUE(std::isfinite(tiny)) << tiny;
}

// Regression (MatmulPeakDrewFromTheTrainingStream): the measurement leaves the default
// generator, the training's random stream, where it was.
TEST(MatmulPeak, LeavesTheDefaultGeneratorAlone) {
  torch::manual_seed(3);
  const auto before = at::randn({4});
  torch::manual_seed(3);
  MatmulPeakOptions small;
  small.min_size = 16;
  small.max_size = 32;
  small.repeats = 1;
  small.budget_s = 0;
  measure_cpu_matmul_peak(small);
  EXPECT_TRUE(at::equal(at::randn({4}), before));
}

TEST(MatmulPeak, BadOptionsAreRefused) {
  for (auto bad : {MatmulPeakOptions{0, 8, 1, 0}, MatmulPeakOptions{16, 8, 1, 0},
                   MatmulPeakOptions{8, 8, 0, 0}, MatmulPeakOptions{8, 8, 1, -1},
                   MatmulPeakOptions{8, 8, 1, std::nan("")}}) {
    EXPECT_THROW(measure_cpu_matmul_peak(bad), UsageError)
        << bad.min_size << ".." << bad.max_size << " x" << bad.repeats;
  }
}

TEST(ModelFlopsUtilization, IsAchievedOverThePeakOfEveryDevice) {
  EXPECT_DOUBLE_EQ(model_flops_utilization(1e9, 2e9, 2), 0.25);
  EXPECT_DOUBLE_EQ(model_flops_utilization(3e12, 1e12, 4), 0.75);
  EXPECT_EQ(model_flops_utilization(0, 2e9, 2), 0) << "the model states no FLOPs";
  EXPECT_EQ(model_flops_utilization(1e9, 0, 2), 0) << "the peak is unknown";
  EXPECT_EQ(model_flops_utilization(1e9, 2e9, 0), 0);
  EXPECT_EQ(model_flops_utilization(std::nan(""), 2e9, 1), 0);
}

TEST(FormatFlops, ThreeDigitsUnderThePrefix) {
  EXPECT_EQ(format_flops(1.234e9), "1.23 GFLOP/s");
  EXPECT_EQ(format_flops(45.6e6), "45.6 MFLOP/s");
  EXPECT_EQ(format_flops(456.7e12), "457 TFLOP/s");
  EXPECT_EQ(format_flops(12), "12.0 FLOP/s");
  EXPECT_EQ(format_flops(2.5e18), "2500 PFLOP/s");
  EXPECT_EQ(format_flops(0), "0 FLOP/s");
}

// ---- The trainer's MFU -------------------------------------------------------------------------

ModelOptions gpt_options() {
  ModelOptions o;
  o.vocab_size = 16;
  o.context = 8;
  return o;
}

// 64 windows of 8 tokens and their next tokens, for gpt-tiny; or the same for a model that
// states no FLOPs.
TrainTask token_task(bool with_flops) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto tokens = at::randint(0, 16, {64, 9}, g, at::kLong);
  Dataset data{tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous(), 16};
  TrainTask t;
  t.train_data = in_memory(data);
  t.test_data = in_memory(data, 16);
  t.model = [with_flops] {
    Model m = make_model("gpt-tiny", gpt_options());
    if (!with_flops) m.flops_per_sample = 0;
    return m;
  };
  return t;
}

TrainerOptions options(const std::filesystem::path& out) {
  TrainerOptions o;
  o.epochs = 1;
  o.batch_size = 16;
  o.progress = false;
  o.tensorboard = false;
  o.out_dir = out.string();
  o.resume = Resume::none();
  o.device = at::kCPU;
  return o;
}

std::vector<TrainResult> train_ranks(int n, const TrainTask& task, const TrainerOptions& o) {
  std::vector<TrainResult> results(static_cast<size_t>(n));
  auto errors = testing::run_ranks(
      n, [&](Dist& d) { results[static_cast<size_t>(d.rank())] = train(task, o, d); });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(n)));
  return results;
}

// The achieved FLOPs are the model's per sample times the samples/s, to rounding.
void expect_achieved(const TrainResult& r) {
  const double want = 8.0 * 619008 * r.samples_per_second;
  EXPECT_GT(r.samples_per_second, 0);
  EXPECT_NEAR(r.model_flops_per_second, want, 1e-12 * want);
}

TEST(TrainerMfu, GptOnTheCpuIsMeasuredAgainstTheMatmulPeak) {
  TempDir dir("mfu_measured");
  const auto r = train_ranks(1, token_task(true), options(dir.path))[0];
  expect_achieved(r);
  EXPECT_TRUE(r.peak_measured);
  EXPECT_GT(r.peak_flops, 0);
  EXPECT_TRUE(std::isfinite(r.peak_flops));
  EXPECT_GT(r.mfu, 0);
  EXPECT_NEAR(r.mfu, r.model_flops_per_second / r.peak_flops, 1e-12 * r.mfu);
}

// Two ranks: the achieved FLOPs are the world's, against two ranks' peaks.
TEST(TrainerMfu, TheRanksTogetherAgainstEveryRanksPeak) {
  TempDir dir("mfu_two_ranks");
  for (const auto& r : train_ranks(2, token_task(true), options(dir.path))) {
    expect_achieved(r);
    EXPECT_TRUE(r.peak_measured);
    EXPECT_GT(r.mfu, 0);
    EXPECT_NEAR(r.mfu, r.model_flops_per_second / (2 * r.peak_flops), 1e-12 * r.mfu);
  }
}

TEST(TrainerMfu, AGivenPeakIsUsedAsItIs) {
  TempDir dir("mfu_given");
  auto o = options(dir.path);
  o.peak_flops = 5e9;
  const auto r = train_ranks(1, token_task(true), o)[0];
  expect_achieved(r);
  EXPECT_FALSE(r.peak_measured);
  EXPECT_EQ(r.peak_flops, 5e9);
  EXPECT_NEAR(r.mfu, r.model_flops_per_second / 5e9, 1e-12 * r.mfu);
}

TEST(TrainerMfu, AModelWithoutFlopsReportsNone) {
  TempDir dir("mfu_none");
  const auto r = train_ranks(1, token_task(false), options(dir.path))[0];
  EXPECT_GT(r.samples_per_second, 0);
  EXPECT_EQ(r.model_flops_per_second, 0);
  EXPECT_EQ(r.mfu, 0);
  EXPECT_EQ(r.peak_flops, 0) << "nothing is measured for a model without FLOPs";
  EXPECT_FALSE(r.peak_measured);
}

TEST(TrainerMfu, ABadPeakIsRefusedNamingTheFlag) {
  TempDir dir("mfu_bad_peak");
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    auto o = options(dir.path);
    o.peak_flops = bad;
    try {
      validate(o, 1);
      FAIL() << "peak_flops " << bad << " was taken";
    } catch (const UsageError& e) {
      // The library names its option; the command line, below, the flag.
      EXPECT_NE(std::string(e.what()).find("TrainerOptions::peak_flops"), std::string::npos)
          << e.what();
    }
  }
  auto cli = testing::run_command(testing::cli_path() +
                                  " train --device cpu --dataset synthetic --peak-flops -1 --out " +
                                  (dir.path / "run").string());
  EXPECT_EQ(cli.exit_code, 2) << cli.output;
  EXPECT_NE(cli.output.find("--peak-flops -1 must be"), std::string::npos) << cli.output;
}

}  // namespace
}  // namespace scaletrain
