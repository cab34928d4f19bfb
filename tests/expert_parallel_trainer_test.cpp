// The trainer's expert parallelism (Note [Expert parallelism applied after context parallelism]
// in src/train/tp_apply.h): the zoo's GPT and Llama with MoE layers trained under ddp with the
// experts spread over 2 and 4 ranks follow the same world with every expert on every rank
// (final weights, losses, test accuracy), with tensor, sequence and context parallelism beside
// it, with accumulation and clipping, under zero1, zero2 and fsdp (with the experts sharded over
// edp), in bf16 autocast; a run stopped
// mid-epoch at ep 2 resumes at ep 1 and the other way round, from PyTorch's DCP layout and from
// one file; bad combinations are UsageErrors naming the option and the fix, and the command line
// exits 2 on them.
// Float64: a token's path through the layer is the same sums at every ep degree (Note [Expert
// parallelism tolerance] in expert_parallel_test.cpp: 1e-14 of the scale per step); after 8
// steps the weights agree within 1e-9 of each tensor's largest entry, as the other trainer
// transparency tests allow, and an expert averaged over the wrong ranks, or a token at the
// wrong expert, is off by 1e-3 of it or more. The load-balancing loss is on: each rank's is
// over its own tokens at every degree, so it is the same loss.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"
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

ModelOptions moe_model_options(int64_t experts = 4, int64_t top_k = 2) {
  ModelOptions o;
  o.vocab_size = 16;
  o.context = 8;
  o.experts = experts;
  o.top_k = top_k;
  return o;
}

// The data and the starting weights of `name` with MoE layers (support/token_runs.h).
testing::ZooTokens moe_tokens(const std::string& name, ModelOptions mo) {
  return testing::ZooTokens(name, mo, 12);
}

// Adam, whose moments a resume must carry (SGD without momentum, the default, has none).
TrainTask with_adam(TrainTask t) {
  t.optimizer = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
  };
  return t;
}

TrainerOptions ep_options(const fs::path& out, int ep) {
  TrainerOptions o = testing::token_run_options(out);
  o.expert_parallel.size = ep;
  return o;
}

using testing::run_world;
// The same run, its MoE layers checked to be there.
void expect_moe_run(const testing::ZooTokens& data, const TrainResult& got, const TrainResult& want,
                    const std::string& what) {
  const auto names = data.weights_of(want.weights_path);
  EXPECT_TRUE(names.count("transformer.h.0.moe.w1") || names.count("model.layers.0.moe.w1"))
      << what;
  testing::expect_same_run(data, got, want, what);
}

TEST(TrainExpertParallel, GptFollowsEveryExpertOnEveryRank) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  for (int world : {2, 4}) {
    TempDir one("ep_one");
    const auto r1 = run_world(world, data.task(), ep_options(one.path, 1));
    ASSERT_EQ(r1.global_step, 8);
    for (int ep = 2; ep <= world; ep *= 2) {
      TempDir dir("ep_ddp");
      const std::string what = "world " + std::to_string(world) + ", ep " + std::to_string(ep);
      expect_moe_run(data, run_world(world, data.task(), ep_options(dir.path, ep)), r1, what);
    }
  }
}

// Under ZeRO the units leave the experts out (ShardOptions::ignored_parameters): the other
// weights sharded over dp, the experts stepped beside the shards. zero1, zero2 and fsdp at ep 2
// of 2 ranks follow ddp with every expert on every rank (nothing sharded, the experts ordinary
// parameters); fsdp x tp 2 x ep 2 follows fsdp x tp 2 at ep 1. At 4 ranks fsdp at ep 2 shards
// each ep rank's 2 experts over its 2 edp ranks (MoEImpl::shard_experts: gathered forward,
// reduce-scattered backward), and follows ddp at ep 1. Adam, whose moments of the experts are
// stepped beside the shards'.
TEST(TrainExpertParallel, ShardedStrategiesSpreadTheExperts) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  TempDir ddp("epzs_ddp");
  const auto r1 = run_world(2, with_adam(data.task()), ep_options(ddp.path, 1));
  for (Strategy s : {Strategy::kZero1, Strategy::kZero2, Strategy::kFsdp}) {
    TempDir dir("epzs");
    auto o = ep_options(dir.path, 2);
    o.strategy = s;
    expect_moe_run(data, run_world(2, with_adam(data.task()), o), r1,
                   to_string(s) + " x ep 2 against ddp at ep 1");
  }
  auto fsdp = [](const fs::path& out, int ep, int tp) {
    auto o = ep_options(out, ep);
    o.strategy = Strategy::kFsdp;
    o.tensor_parallel.size = tp;
    return o;
  };
  TempDir one("epzs_one"), two("epzs_two"), whole("epzs_whole"), efsdp("epzs_efsdp");
  const auto r4 = run_world(4, with_adam(data.task()), fsdp(one.path, 1, 2));
  expect_moe_run(data, run_world(4, with_adam(data.task()), fsdp(two.path, 2, 2)), r4,
                 "fsdp x tp 2 x ep 2");
  const auto d4 = run_world(4, with_adam(data.task()), ep_options(whole.path, 1));
  const auto sharded = run_world(4, with_adam(data.task()), fsdp(efsdp.path, 2, 1));
  expect_moe_run(data, sharded, d4, "fsdp x ep 2 x efsdp 2 against ddp at ep 1");
  // A rank holds a quarter of the experts (whole on their ep ranks: a half), and a quarter of
  // the rest, give or take the units' padding (under 4 elements a unit).
  int64_t experts = 0, rest = 0;
  for (const auto& [name, w] : data.weights_of(d4.weights_path)) {
    const bool expert = name.find(".moe.w") != std::string::npos;
    (expert ? experts : rest) += w.numel();
  }
  ASSERT_FALSE(sharded.devices.empty());
  EXPECT_NEAR(double(sharded.devices[0].parameters), double(experts + rest) / 4, 100)
      << experts << " expert parameters, " << rest << " others";
  EXPECT_GT(experts / 4, 400);
}

// At 2 ranks fsdp at ep 2 holds its experts whole; at 4 ranks it shards them over edp 2, and a
// checkpoint's boxes place each rank's quarter of them by global index (PyTorch's DCP layout).
TEST(TrainExpertParallel, FsdpAtEpTwoAndDdpAtEpOneResumeEachOther) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  struct Leg {
    int world;
    Strategy from;
    int from_ep;
    Strategy to;
    int to_ep;
  };
  TempDir two("epzr_two"), four("epzr_four");
  std::map<int, TrainResult> straight{
      {2, run_world(2, with_adam(data.task()), ep_options(two.path, 1))},
      {4, run_world(4, with_adam(data.task()), ep_options(four.path, 1))}};
  for (const Leg& l : {Leg{2, Strategy::kFsdp, 2, Strategy::kDDP, 1},
                       Leg{2, Strategy::kDDP, 1, Strategy::kFsdp, 2},
                       Leg{4, Strategy::kFsdp, 2, Strategy::kDDP, 4},
                       Leg{4, Strategy::kDDP, 1, Strategy::kFsdp, 2}}) {
    const std::string what = to_string(l.from) + " at ep " + std::to_string(l.from_ep) +
                             " resumed under " + to_string(l.to) + " at ep " +
                             std::to_string(l.to_ep) + " on " + std::to_string(l.world) + " ranks";
    TempDir dir("epzr");
    auto o = ep_options(dir.path, l.from_ep);
    o.strategy = l.from;
    o.checkpoint_every = 1;
    testing::stop_at_step(l.world, with_adam(data.task()), o, 5);
    o.strategy = l.to;
    o.expert_parallel.size = l.to_ep;
    o.resume = Resume::automatic();
    const auto resumed = run_world(l.world, with_adam(data.task()), o);
    EXPECT_EQ(resumed.global_step, 8) << what;
    testing::expect_same_weights(data, resumed.weights_path, straight[l.world].weights_path, what);
  }
}

// The experts are not in the tensor-parallel plan: whole on every rank of a tp group, which
// dispatches the same tokens (each tp rank in an ep group of its own tp coordinate); with
// sequence parallelism each tp rank routes its slice of the sequence, and the experts'
// gradients are summed over tp with the other replicated parameters'.
TEST(TrainExpertParallel, TensorParallelGptFollowsEveryExpertOnEveryRank) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  for (bool sp : {false, true}) {
    auto options = [sp](const fs::path& out, int ep) {
      auto o = ep_options(out, ep);
      o.tensor_parallel.size = 2;
      o.tensor_parallel.sequence_parallel = sp;
      return o;
    };
    TempDir one("eptp_one"), two("eptp_two");
    const auto r1 = run_world(4, data.task(), options(one.path, 1));
    expect_moe_run(data, run_world(4, data.task(), options(two.path, 2)), r1,
                   std::string("tp 2 x ep 2") + (sp ? ", sequence parallel" : ""));
  }
}

// ep borrows from dp x cp: the ranks of a sequence's cp group may hold different experts.
TEST(TrainExpertParallel, ContextParallelGptFollowsEveryExpertOnEveryRank) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  for (int world : {2, 4}) {
    auto options = [](const fs::path& out, int ep) {
      auto o = ep_options(out, ep);
      o.context_parallel.size = 2;
      return o;
    };
    TempDir one("epcp_one"), two("epcp_two");
    const auto r1 = run_world(world, data.task(), options(one.path, 1));
    expect_moe_run(data, run_world(world, data.task(), options(two.path, 2)), r1,
                   "cp 2 x ep 2 at world " + std::to_string(world));
  }
}

// Where features cross: two batches per step, the gradients clipped by their global norm (the
// experts' squares summed over the ep group), and each block recomputed in backward (its
// all-to-alls again, inside backward, in the same order on every rank), at ep 2 against every
// expert on every rank without recomputation.
TEST(TrainExpertParallel, AccumulationClippingAndRecomputationFollowEveryExpertOnEveryRank) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 1));
  auto options = [](const fs::path& out, int ep) {
    auto o = ep_options(out, ep);
    o.accumulate = 2;
    o.batch_size = 8;
    o.max_grad_norm = 0.05;  // below the norms here: every step clips
    return o;
  };
  TempDir one("epc_one"), two("epc_two");
  const auto r1 = run_world(2, data.task(), options(one.path, 1));
  ModelOptions recomputed = data.options;
  recomputed.checkpoint_activations = true;
  expect_moe_run(data, run_world(2, data.task(recomputed), options(two.path, 2)), r1,
                 "ep 2, accumulate 2, clipped, recomputed blocks");
}

TEST(TrainExpertParallel, LlamaFollowsEveryExpertOnEveryRank) {
  const auto data = moe_tokens("llama-tiny", moe_model_options(4, 2));
  TempDir one("epl_one"), two("epl_two");
  const auto r1 = run_world(2, data.task(), ep_options(one.path, 1));
  expect_moe_run(data, run_world(2, data.task(), ep_options(two.path, 2)), r1, "llama ep 2");
}

TEST(TrainExpertParallel, ResumesMidEpochAtAnotherDegree) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  TempDir whole("epr_whole");
  const auto straight = run_world(2, data.task(), ep_options(whole.path, 1));
  struct Case {
    int from, to;
    CheckpointFormat format;
  };
  for (const Case& c : {Case{2, 1, CheckpointFormat::kDcp}, Case{1, 2, CheckpointFormat::kDcp},
                        Case{2, 1, CheckpointFormat::kFull}}) {
    const std::string what = "ep " + std::to_string(c.from) + " -> " + std::to_string(c.to) +
                             (c.format == CheckpointFormat::kFull ? " (one file)" : " (dcp)");
    TempDir dir("epr");
    auto o = ep_options(dir.path, c.from);
    o.checkpoint_every = 1;
    o.checkpoint_format = c.format;
    testing::stop_at_step(2, data.task(), o, 5);
    o.expert_parallel.size = c.to;
    o.resume = Resume::automatic();
    const auto resumed = run_world(2, data.task(), o);
    EXPECT_EQ(resumed.global_step, 8) << what;
    testing::expect_same_weights(data, resumed.weights_path, straight.weights_path, what);
  }
}

// bf16 under ZeRO with ep: the trained model is a build of its own, as under tp, and computes
// under bf16 autocast with its fp32 weights and gradients the masters, as ddp's does. float32
// (the other tests' float64 is outside autocast), one SGD step of the whole batch on 4 ranks.
//
// Note [bf16 under ep]: ddp, zero2 (the experts whole) and fsdp (the experts sharded) compute the
// same bf16 products from the same fp32 weights, so the step's gradients differ only by the
// order of their fp32 sums over the ranks (all-reduce, reduce-scatter): a few units of 2^-24 of
// the gradient's terms. The step moves a weight by lr · g; the strategies' weights then agree
// within 1e-4 of the largest move of each tensor. A step computed in fp32 instead differs from
// bf16's by bf16's rounding of the products, 2^-9 of them and more after the sums: some tensor
// moves otherwise by more than 1e-3 of its largest move, which shows that autocast was on.
// (After several steps, the loss of chaotic rounding makes no such bound: one flip in a bf16
// copy of a weight is 2^-8 of it.)
TEST(TrainExpertParallel, ShardedStrategiesTrainInBf16) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  TrainTask task = data.task();
  task.model = [make = task.model] {
    Model m = make();
    m.module->to(at::kFloat);
    return m;
  };
  std::vector<std::unique_ptr<TempDir>> dirs;
  auto run = [&](Strategy s, Amp amp) {
    dirs.push_back(std::make_unique<TempDir>("ep_bf16"));
    auto o = ep_options(dirs.back()->path, 2);
    o.strategy = s;
    o.amp = amp;
    o.epochs = 1;
    o.batch_size = 64;
    const auto r = run_world(4, task, o);
    EXPECT_EQ(r.global_step, 1);
    return data.weights_of(r.weights_path);
  };
  const auto ddp = run(Strategy::kDDP, Amp::kBf16);
  const auto fp32 = run(Strategy::kFsdp, Amp::kNone);
  double widest = 0;  // the fp32 step's largest difference, in moves
  for (Strategy s : {Strategy::kZero2, Strategy::kFsdp}) {
    const auto got = run(s, Amp::kBf16);
    for (const auto& [name, w] : ddp) {
      const double move = (w - data.start.at(name)).abs().max().item<double>();
      const double diff = (got.at(name) - w).abs().max().item<double>();
      EXPECT_LE(diff, 1e-4 * move) << to_string(s) << ": " << name << " moved " << move;
      widest = std::max(widest, (fp32.at(name) - w).abs().max().item<double>() / move);
    }
  }
  EXPECT_GT(widest, 1e-3) << "the fp32 step is the bf16 step: was autocast on?";
}

TEST(TrainExpertParallel, BadCombinationsAreNamed) {
  const auto data = moe_tokens("gpt-tiny", moe_model_options(4, 2));
  TempDir dir("ep_bad");
  const auto expect_error = testing::expect_train_error;
  auto o = ep_options(dir.path, 2);
  o.strategy = Strategy::kGrid;
  o.pipeline.stages = 2;
  expect_error(4, o, "goes with TrainerOptions::strategy ddp, zero1, zero2 or fsdp (grid",
               data.task());
  expect_error(4, ep_options(dir.path, 3), "does not divide the 4 data-parallel ranks",
               data.task());
  expect_error(2, ep_options(dir.path, 0), "is at least 1", data.task());
  o = ep_options(dir.path, 4);
  o.tensor_parallel.size = 2;
  expect_error(4, o, "does not divide the 2 data-parallel ranks", data.task());
  const auto dense = moe_tokens("gpt-tiny", moe_model_options(0));
  expect_error(2, ep_options(dir.path, 2), "has no MoE layer", dense.task());
  const auto six = moe_tokens("gpt-tiny", moe_model_options(6, 2));
  expect_error(4, ep_options(dir.path, 4), "6 experts cannot be spread over --ep 4", six.task());
}

TEST(TrainExpertParallel, CommandLineTrainsAndRefusesWithExitTwo) {
  TempDir dir("ep_cli");
  auto data = testing::run_command(testing::cli_path() + " data text --input " +
                                   testing::script_path("hf_reference.py") + " --out " +
                                   (dir.path / "text").string() + " 2>&1");
  ASSERT_EQ(data.exit_code, 0) << data.output;
  const std::string gpt = testing::cli_path() + " train --model gpt-tiny --dataset text " +
                          "--data-dir " + (dir.path / "text").string() + " --out " +
                          (dir.path / "gpt").string() + " --context 16";
  struct Refusal {
    std::string flags, part;
  };
  for (const Refusal& r :
       {Refusal{"--nproc-per-node 2 --ep 2",
                "--ep 2 spreads the experts of MoE layers, and the model has none"},
        Refusal{"--nproc-per-node 2 --experts 4 --top-k 5",
                "--top-k 5 must be between 1 and --experts 4"},
        Refusal{"--experts 6 --ep 4 --nproc-per-node 4",
                "--experts 6 does not spread evenly over --ep 4 ranks"},
        Refusal{"--experts 4 --ep 2 --strategy pipeline",
                "--ep 2 goes with --strategy ddp, zero1, zero2 or fsdp"},
        Refusal{"--nproc-per-node 2 --experts -1", "--experts -1"}}) {
    auto got = testing::run_command(gpt + " " + r.flags + " 2>&1", 60);
    EXPECT_EQ(got.exit_code, 2) << r.flags << ": " << got.output;
    EXPECT_NE(got.output.find(r.part), std::string::npos) << r.flags << ": " << got.output;
  }
  auto got = testing::run_command(
      gpt + " --nproc-per-node 2 --experts 4 --ep 2 --limit-train 32 --limit-test 16 " +
          "--epochs 1 --batch-size 8 --device cpu 2>&1",
      180);
  EXPECT_EQ(got.exit_code, 0) << got.output;
  EXPECT_NE(got.output.find("--strategy ddp --ep 2"), std::string::npos) << got.output;
}

}  // namespace
}  // namespace scaletrain
