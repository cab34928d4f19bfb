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
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
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

// 64 windows of 8 tokens (next-token targets) and one set of starting weights of `name`.
struct CpTokens {
  std::string name;
  Dataset train, test;
  std::map<std::string, at::Tensor> start;
  explicit CpTokens(std::string model) : name(std::move(model)) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(11);
    auto tokens = at::randint(0, 16, {64, 9}, g, at::kLong);
    train = Dataset{tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous(), 16};
    test = Dataset{train.inputs.narrow(0, 0, 16), train.targets.narrow(0, 0, 16), 16};
    Model m = make_model(name, cp_model_options());
    m.module->to(at::kDouble);
    for (const auto& p : m.module->named_parameters()) start[p.key()] = p.value().detach().clone();
  }
  TrainTask task(double dropout = 0, bool recompute = false) const {
    TrainTask t;
    t.train_data = in_memory(train);
    t.test_data = in_memory(test);
    t.model = [this, dropout, recompute] {
      Model m = make_model(name, cp_model_options(dropout, recompute));
      m.module->to(at::kDouble);
      torch::NoGradGuard no_grad;
      for (auto& p : m.module->named_parameters()) p.value().copy_(start.at(p.key()));
      return m;
    };
    return t;
  }
  std::map<std::string, at::Tensor> weights_of(const std::string& path) const {
    Model m = make_model(name, cp_model_options());
    m.module->to(at::kDouble);
    load_weights(path, *m.module);
    std::map<std::string, at::Tensor> out;
    for (const auto& p : m.module->named_parameters()) out[p.key()] = p.value().detach().clone();
    return out;
  }
};

TrainerOptions cp_options(const fs::path& out, int cp, int tp = 1) {
  TrainerOptions o;
  o.epochs = 2;
  o.batch_size = 16;
  o.progress = false;
  o.tensorboard = false;
  o.out_dir = out.string();
  o.resume = Resume::none();
  o.device = at::kCPU;
  o.context_parallel.size = cp;
  o.tensor_parallel.size = tp;
  return o;
}

TrainResult cp_run(int world, const TrainTask& task, const TrainerOptions& o) {
  TrainResult r;
  auto errors = testing::run_ranks(world, [&](Dist& d) {
    auto mine = train(task, o, d);
    if (d.rank() == 0) r = mine;
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
  return r;
}

void expect_same_run(const CpTokens& data, const TrainResult& got, const TrainResult& want,
                     const std::string& what) {
  EXPECT_EQ(got.global_step, want.global_step) << what;
  EXPECT_NEAR(got.final_loss, want.final_loss, 1e-9 * want.final_loss) << what;
  EXPECT_NEAR(got.test_accuracy, want.test_accuracy, 1e-12) << what;
  const auto a = data.weights_of(got.weights_path), b = data.weights_of(want.weights_path);
  for (const auto& [name, w] : b) {
    const double bound = 1e-9 * w.abs().max().item<double>() + 1e-13;
    const double err = (a.at(name) - w).abs().max().item<double>();
    EXPECT_LE(err, bound) << what << ": " << name << " off by " << err;
  }
}

TEST(TrainContextParallel, GptFollowsTheSingleRankUnderDdp) {
  const CpTokens data("gpt-tiny");
  TempDir one("cp_one");
  const auto r1 = cp_run(1, data.task(), cp_options(one.path, 1));
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
    expect_same_run(data, cp_run(c.world, data.task(), o), r1, c.what);
  }
}

TEST(TrainContextParallel, GptFollowsTheSingleRankUnderZeroAndFsdp) {
  const CpTokens data("gpt-tiny");
  TempDir one("cpz_one");
  const auto r1 = cp_run(1, data.task(), cp_options(one.path, 1));
  for (Strategy s : {Strategy::kZero1, Strategy::kZero2, Strategy::kFsdp}) {
    TempDir dir("cpz");
    auto o = cp_options(dir.path, 2);
    o.strategy = s;
    expect_same_run(data, cp_run(2, data.task(), o), r1, to_string(s) + " x cp 2");
  }
  TempDir dir("cpz_tp");
  auto o = cp_options(dir.path, 2, 2);
  o.strategy = Strategy::kFsdp;
  o.tensor_parallel.sequence_parallel = true;
  expect_same_run(data, cp_run(4, data.task(), o), r1, "fsdp x cp 2 x tp 2, sequence parallel");
}

// Where features cross: each block recomputed in backward (its ring attention runs again inside
// backward, its hops in the same order on both ranks), two batches per optimizer step, and the
// gradients clipped by their global norm, at cp 2 against the same on one rank.
TEST(TrainContextParallel, RecomputedBlocksAccumulationAndClippingFollowTheSingleRank) {
  const CpTokens data("gpt-tiny");
  TempDir one("cpx_one"), two("cpx_two");
  auto o1 = cp_options(one.path, 1);
  o1.accumulate = 2;
  o1.batch_size = 8;
  o1.max_grad_norm = 0.05;
  auto o2 = o1;
  o2.out_dir = two.path.string();
  o2.context_parallel.size = 2;
  const auto r1 = cp_run(1, data.task(0, /*recompute=*/true), o1);
  ASSERT_EQ(r1.global_step, 16);  // batches: 8 optimizer steps
  expect_same_run(data, cp_run(2, data.task(0, /*recompute=*/true), o2), r1,
                  "cp 2, recomputed blocks, accumulate 2, clipped");
}

// The grid: 2 pipeline stages, each with its sequences over cp 2 (the mesh {dp 1, cp 2, pp 2}):
// the first stage takes the inputs' slices, the last the targets', DDP averages each stage
// over its cp ranks.
TEST(TrainContextParallel, GridFollowsTheSingleRank) {
  const CpTokens data("gpt-tiny");
  TempDir one("cpg_one"), grid("cpg_grid");
  const auto r1 = cp_run(1, data.task(), cp_options(one.path, 1));
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
  expect_same_run(data, cp_run(4, task, o), r1, "pp 2 x cp 2");
  EXPECT_EQ(split_models.load(), 4);
}

// Llama: its rotary embeddings at the slice's true positions, its grouped key/value heads
// exchanged as they are (4 heads over 2).
TEST(TrainContextParallel, LlamaFollowsTheSingleRank) {
  const CpTokens data("llama-tiny");
  TempDir one("cpl_one"), two("cpl_two"), four("cpl_four");
  const auto r1 = cp_run(1, data.task(), cp_options(one.path, 1));
  expect_same_run(data, cp_run(2, data.task(), cp_options(two.path, 2)), r1, "llama cp 2");
  expect_same_run(data, cp_run(4, data.task(), cp_options(four.path, 2, 2)), r1,
                  "llama cp 2 x tp 2");
}

// Stopped after step 5 (mid-epoch 2) at cp 2; resumed at cp 1 on one rank and at cp 4 on four:
// both end on the uninterrupted run's weights (the checkpoint holds whole weights and the
// replica's sampler position, which a cp group shares).
TEST(TrainContextParallel, ResumesMidEpochAtAnotherDegree) {
  const CpTokens data("gpt-tiny");
  TempDir whole("cpr_whole");
  const auto straight = cp_run(1, data.task(), cp_options(whole.path, 1));
  for (int to : {1, 4}) {
    TempDir dir("cpr");
    auto o = cp_options(dir.path, 2);
    o.checkpoint_every = 1;
    const std::string stop = "stopped at step 5";
    auto stopped = testing::run_ranks(2, [&](Dist& d) {
      TrainTask t = data.task();
      t.on_step = [&](const StepReport& r) {
        if (r.global_step == 5) throw std::runtime_error(stop);
      };
      train(t, o, d);
    });
    for (const auto& e : stopped) ASSERT_EQ(e, stop);
    o.context_parallel.size = to;
    o.resume = Resume::automatic();
    const auto resumed = cp_run(to, data.task(), o);
    EXPECT_EQ(resumed.global_step, 8);
    const auto a = data.weights_of(resumed.weights_path),
               b = data.weights_of(straight.weights_path);
    for (const auto& [name, w] : b) {
      EXPECT_LE((a.at(name) - w).abs().max().item<double>(),
                1e-9 * w.abs().max().item<double>() + 1e-13)
          << "resumed at cp " << to << ": " << name;
    }
  }
}

std::string train_error(int world, const TrainTask& task, const TrainerOptions& o) {
  auto errors = testing::run_ranks(world, [&](Dist& d) { train(task, o, d); });
  return errors.at(0);
}

TEST(TrainContextParallel, BadCombinationsAreNamed) {
  const CpTokens data("gpt-tiny");
  TempDir dir("cp_bad");
  auto expect_error = [&](int world, TrainerOptions o, const std::string& part,
                          const TrainTask& task) {
    o.overwrite = true;  // a run refused in its ranks leaves its folder's first files
    const std::string e = train_error(world, task, o);
    EXPECT_NE(e.find(part), std::string::npos) << "wanted '" << part << "' in: " << e;
  };
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
  expect_error(2, cp_options(dir.path, 2), "train it with dropout 0", data.task(/*dropout=*/0.1));
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
  // Before any rank starts: LeNet has no attention; a GPT with dropout; a context the chunks
  // do not divide.
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
  r = testing::run_command(gpt + " --context 8 --dropout 0.1 2>&1", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("give --dropout 0 with --cp"), std::string::npos) << r.output;
  r = testing::run_command(gpt + " --context 6 2>&1", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--context 6 does not cut into 4 equal chunks"), std::string::npos)
      << r.output;
  // And a run that trains: two ranks, each sequence of 16 over both.
  r = testing::run_command(gpt + " --context 16 --limit-train 32 --limit-test 16 --epochs 1 " +
                               "--batch-size 8 --device cpu 2>&1",
                           120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--strategy ddp --cp 2"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace scaletrain
