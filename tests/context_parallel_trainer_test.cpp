// The trainer's context parallelism (Note [Context parallelism applied after tensor parallelism]
// in src/train/tp_apply.h): the zoo's GPT and Llama trained with each sequence cut over 2 and 4
// ranks follow the single rank's run (final weights, losses, test accuracy), under ddp, zero1,
// zero2 and fsdp, load-balanced and in order, with tensor parallelism and with data parallelism
// beside it; a run stopped mid-epoch at cp 2 resumes at cp 1 and at cp 4; bad combinations are
// UsageErrors naming the option and the fix, and the command line exits 2 on them.
// Float64: Note [Ring attention tolerance] in context_parallel_test.cpp bounds one step's
// regrouping by 1e-13 of the inputs' scale; after 8 steps the weights agree within 1e-9 of each
// tensor's largest entry, as the tensor-parallel trainer's tests allow, and a missing block or a
// gradient averaged over the wrong ranks is off by 1e-3 of it or more.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "gpt.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/token_runs.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

ModelOptions cp_model_options(double dropout = 0, bool recompute = false) {
  ModelOptions o;
  o.vocab_size = 16;
  o.context = 8;
  o.dropout = dropout;
  o.checkpoint_activations = recompute;
  return o;
}

// The data and the starting weights of `name` (support/token_runs.h).
testing::ZooTokens cp_tokens(const std::string& name) {
  return testing::ZooTokens(name, cp_model_options(), 11);
}

TrainerOptions cp_options(const fs::path& out, int cp, int tp = 1) {
  TrainerOptions o = testing::token_run_options(out);
  o.context_parallel.size = cp;
  o.tensor_parallel.size = tp;
  return o;
}

using testing::expect_same_run;
using testing::run_world;

TEST(TrainContextParallel, GptFollowsTheSingleRankUnderDdp) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir one("cp_one");
  const auto r1 = run_world(1, data.task(), cp_options(one.path, 1));
  ASSERT_EQ(r1.global_step, 8);
  struct Case {
    int world, cp, tp;
    bool balanced;
    std::string what;
  };
  for (const Case& c : {Case{2, 2, 1, true, "cp 2"}, Case{2, 2, 1, false, "cp 2 in order"},
                        Case{4, 4, 1, true, "cp 4"}, Case{4, 2, 1, true, "dp 2 x cp 2"},
                        Case{4, 2, 2, true, "cp 2 x tp 2"}}) {
    TempDir dir("cp_ddp");
    auto o = cp_options(dir.path, c.cp, c.tp);
    o.context_parallel.load_balanced = c.balanced;
    expect_same_run(data, run_world(c.world, data.task(), o), r1, c.what);
  }
}

TEST(TrainContextParallel, GptFollowsTheSingleRankUnderZeroAndFsdp) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir one("cpz_one");
  const auto r1 = run_world(1, data.task(), cp_options(one.path, 1));
  for (Strategy s : {Strategy::kZero1, Strategy::kZero2, Strategy::kFsdp}) {
    TempDir dir("cpz");
    auto o = cp_options(dir.path, 2);
    o.strategy = s;
    expect_same_run(data, run_world(2, data.task(), o), r1, to_string(s) + " x cp 2");
  }
  TempDir dir("cpz_tp");
  auto o = cp_options(dir.path, 2, 2);
  o.strategy = Strategy::kFsdp;
  o.tensor_parallel.sequence_parallel = true;
  expect_same_run(data, run_world(4, data.task(), o), r1, "fsdp x cp 2 x tp 2, sequence parallel");
}

// A GPT with dropout (embeddings, attention probabilities, residual branches): each rank of a
// cp group draws the whole masks and keeps its positions' part (Note [Ring attention with
// dropout] in src/cp/ring_attention.cpp), so cp 2 and cp 2 x tp 2 with sequence parallelism
// draw the single rank's masks and follow its run. The ranks here are threads of one process,
// which share its default generator: each model draws from a generator of its own, every one
// seeded alike, as the trainer's streams seed a cp group's processes alike
// (Train.GptDropoutUnderTensorParallelDrawsTheSingleProcessMasks runs processes). The same
// tolerance: a mask of other positions or of another draw changes a step by p of it.
TEST(TrainContextParallel, GptWithDropoutDrawsTheSingleRanksMasks) {
  const auto data = cp_tokens("gpt-tiny");
  TrainTask task = data.task(cp_model_options(/*dropout=*/0.2));
  task.model = [make = task.model] {
    Model m = make();
    std::dynamic_pointer_cast<GPTImpl>(m.module)->set_dropout_generator(
        at::make_generator<at::CPUGeneratorImpl>(13));
    return m;
  };
  TempDir one("cpd_one"), two("cpd_two"), four("cpd_four");
  const auto r1 = run_world(1, task, cp_options(one.path, 1));
  expect_same_run(data, run_world(2, task, cp_options(two.path, 2)), r1, "cp 2 with dropout");
  auto o = cp_options(four.path, 2, 2);
  o.tensor_parallel.sequence_parallel = true;
  expect_same_run(data, run_world(4, task, o), r1, "cp 2 x tp 2, sequence parallel, dropout");
  TempDir plain("cpd_plain");
  const auto without = run_world(1, data.task(), cp_options(plain.path, 1));
  EXPECT_GT(std::abs(without.final_loss - r1.final_loss), 1e-3) << "dropout drew no mask";
}

// Where features cross: each block recomputed in backward (its ring attention runs again inside
// backward, its hops in the same order on both ranks), two batches per optimizer step, and the
// gradients clipped by their global norm, at cp 2 against the same on one rank.
TEST(TrainContextParallel, RecomputedBlocksAccumulationAndClippingFollowTheSingleRank) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir one("cpx_one"), two("cpx_two");
  auto o1 = cp_options(one.path, 1);
  o1.accumulate = 2;
  o1.batch_size = 8;
  o1.max_grad_norm = 0.05;
  auto o2 = o1;
  o2.out_dir = two.path.string();
  o2.context_parallel.size = 2;
  const auto r1 = run_world(1, data.task(cp_model_options(0, /*recompute=*/true)), o1);
  ASSERT_EQ(r1.global_step, 16);  // batches: 8 optimizer steps
  expect_same_run(data, run_world(2, data.task(cp_model_options(0, /*recompute=*/true)), o2), r1,
                  "cp 2, recomputed blocks, accumulate 2, clipped");
}

// The grid: 2 pipeline stages, each with its sequences over cp 2 (the mesh {dp 1, cp 2, pp 2}):
// the first stage takes the inputs' slices, the last the targets', DDP averages each stage
// over its cp ranks.
TEST(TrainContextParallel, GridFollowsTheSingleRank) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir one("cpg_one"), grid("cpg_grid");
  const auto r1 = run_world(1, data.task(), cp_options(one.path, 1));
  auto o = cp_options(grid.path, 2);
  o.strategy = Strategy::kGrid;
  o.pipeline.stages = 2;
  // Each rank's model is given a split of degree 2 (a run that left the sequences whole would
  // follow the single rank too).
  std::atomic<int> split_models{0};
  TrainTask task = data.task();
  task.model = [base = task.model, &split_models] {
    Model m = base();
    m.context_parallel = [inner = m.context_parallel, &split_models](const Dist* cp,
                                                                     const ContextSplit& s) {
      if (cp && s.degree == 2) ++split_models;
      inner(cp, s);
    };
    return m;
  };
  expect_same_run(data, run_world(4, task, o), r1, "pp 2 x cp 2");
  EXPECT_EQ(split_models.load(), 4);
}

// Llama: its rotary embeddings at the slice's true positions, its grouped key/value heads
// exchanged as they are (4 heads over 2).
TEST(TrainContextParallel, LlamaFollowsTheSingleRank) {
  const auto data = cp_tokens("llama-tiny");
  TempDir one("cpl_one"), two("cpl_two"), four("cpl_four");
  const auto r1 = run_world(1, data.task(), cp_options(one.path, 1));
  expect_same_run(data, run_world(2, data.task(), cp_options(two.path, 2)), r1, "llama cp 2");
  expect_same_run(data, run_world(4, data.task(), cp_options(four.path, 2, 2)), r1,
                  "llama cp 2 x tp 2");
}

// Stopped after step 5 (mid-epoch 2) at cp 2; resumed at cp 1 on one rank and at cp 4 on four:
// both end on the uninterrupted run's weights (the checkpoint holds whole weights and the
// replica's sampler position, which a cp group shares).
TEST(TrainContextParallel, ResumesMidEpochAtAnotherDegree) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir whole("cpr_whole");
  const auto straight = run_world(1, data.task(), cp_options(whole.path, 1));
  for (int to : {1, 4}) {
    TempDir dir("cpr");
    auto o = cp_options(dir.path, 2);
    o.checkpoint_every = 1;
    testing::stop_at_step(2, data.task(), o, 5);
    o.context_parallel.size = to;
    o.resume = Resume::automatic();
    const auto resumed = run_world(to, data.task(), o);
    EXPECT_EQ(resumed.global_step, 8);
    testing::expect_same_weights(data, resumed.weights_path, straight.weights_path,
                                 "resumed at cp " + std::to_string(to));
  }
}

TEST(TrainContextParallel, BadCombinationsAreNamed) {
  const auto data = cp_tokens("gpt-tiny");
  TempDir dir("cp_bad");
  const auto expect_error = testing::expect_train_error;
  auto o = cp_options(dir.path, 2);
  o.strategy = Strategy::kPipeline;
  expect_error(2, o, "goes with TrainerOptions::strategy ddp, zero1, zero2, fsdp or grid (pipeline",
               data.task());
  o = cp_options(dir.path, 2);
  o.strategy = Strategy::kGrid;
  o.pipeline.stages = 2;
  expect_error(2, o, "dividing the world and TrainerOptions::context_parallel.size 2", data.task());
  expect_error(4, cp_options(dir.path, 3), "does not divide the world of 4 ranks", data.task());
  expect_error(2, cp_options(dir.path, 0), "is at least 1", data.task());
  expect_error(4, cp_options(dir.path, 2, 4),
               "times TrainerOptions::tensor_parallel.size 4 does not divide", data.task());
  // A sequence of 8 tokens over 3 ranks balanced: 6 chunks.
  expect_error(3, cp_options(dir.path, 3), "make the sequence length a multiple of 6", data.task());
  TrainTask no_hook = data.task();
  no_hook.model = [base = no_hook.model] {
    Model m = base();
    m.context_parallel = nullptr;
    return m;
  };
  expect_error(2, cp_options(dir.path, 2), "has no attention to split", no_hook);
}

TEST(TrainContextParallel, CommandLineTrainsAndRefusesWithExitTwo) {
  TempDir dir("cp_cli");
  const std::string run =
      testing::cli_path() + " train --dataset synthetic --epochs 1 --out " + dir.path.string();
  auto r = testing::run_command(run + " --cp 2 --strategy pipeline 2>&1", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--cp 2 goes with --strategy ddp"), std::string::npos) << r.output;
  r = testing::run_command(run + " --cp 0 2>&1", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--cp 0"), std::string::npos) << r.output;
  // Before any rank starts: LeNet has no attention; a context the chunks do not divide.
  r = testing::run_command(run + " --cp 2 --nproc-per-node 2 2>&1", 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--cp 2: --model lenet has no attention"), std::string::npos) << r.output;
  auto data = testing::run_command(testing::cli_path() + " data text --input " +
                                   testing::script_path("hf_reference.py") + " --out " +
                                   (dir.path / "text").string() + " 2>&1");
  ASSERT_EQ(data.exit_code, 0) << data.output;
  const std::string gpt = testing::cli_path() + " train --model gpt-tiny --dataset text " +
                          "--data-dir " + (dir.path / "text").string() + " --out " +
                          (dir.path / "gpt").string() + " --nproc-per-node 2 --cp 2";
  r = testing::run_command(gpt + " --context 6 2>&1", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--context 6 does not cut into 4 equal chunks"), std::string::npos)
      << r.output;
  // And a run that trains: two ranks, each sequence of 16 over both, with dropout.
  r = testing::run_command(gpt + " --context 16 --dropout 0.1 --limit-train 32 --limit-test 16 " +
                               "--epochs 1 " + "--batch-size 8 --device cpu 2>&1",
                           120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--strategy ddp --cp 2"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace scaletrain
