// The trainer end to end: checkpoints, exact resume after a SIGKILL (through the launcher's
// restart), and bad input refused before any training.

#include "scaletrain/trainer.h"
#include "scaletrain_zoo.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>

#include "scaletrain/amp.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/tokens.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/tolerance.h"
#include "train/strategy.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::run_command;

using testing::TempDir;

std::vector<at::Tensor> params_of(const std::string& checkpoint,
                                  const std::string& model = "lenet") {
  Model m = make_model(model);
  load_checkpoint(checkpoint, *m.module, nullptr, model);  // the weights (any strategy's)
  std::vector<at::Tensor> out;
  for (auto& p : m.module->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::string train_cmd(const fs::path& out) {
  return " train --device cpu --dataset synthetic --limit-train 384 --limit-test 64 --epochs 2 "
         "--batch-size 64 --checkpoint-every 2 --log-every 1 --no-progress --out " +
         out.string();
}

// The (step, loss) of every step line (or epoch line) of a metrics file.
std::vector<std::pair<int64_t, double>> step_lines(const fs::path& metrics,
                                                   const std::string& kind = "step") {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == kind) out.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return out;
}

std::map<std::string, std::string> contents_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  // Files in folders too (a DCP checkpoint's ckpt-<step>/, a sharded one's world-<N>/), by
  // their path in `dir`; a folder itself is an entry with no bytes.
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    const auto name = fs::relative(e.path(), dir).string();
    if (e.is_directory()) {
      out[name + "/"] = "";
      continue;
    }
    std::ifstream in(e.path(), std::ios::binary);
    out[name] = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return out;
}

// Two files' bytes alike; else where they first differ (not the megabytes of both, which
// EXPECT_EQ would print).
::testing::AssertionResult same_bytes(const std::string& a, const std::string& b) {
  if (a == b) return ::testing::AssertionSuccess();
  const auto at = std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
  return ::testing::AssertionFailure() << "the files differ from byte " << at << " on (sizes "
                                       << a.size() << " and " << b.size() << ")";
}

// Exact resume after a SIGKILL, for every strategy: rank 0 kills itself in the middle of epoch
// 2, the launcher restarts the group, the run resumes from its newest checkpoint, and the final
// weights and the loss curve are those of a run never killed, bit for bit.
struct Resume {
  std::string name;
  int processes;
  std::string strategy;         // the train flags of the strategy
  std::string model = "lenet";  // the model those flags train
};
void PrintTo(const Resume& r, std::ostream* os) { *os << r.name; }

class ExactResume : public ::testing::TestWithParam<Resume> {};

// Token files of a text Debian ships, for the GPT's cases ({text} in their flags): written once.
struct TextData {
  fs::path dir = fs::temp_directory_path() / ("scaletrain_resume_text_" + std::to_string(getpid()));
  TextData() { write_byte_tokens("/usr/share/common-licenses/GPL-3", dir.string(), 0.1); }
  ~TextData() { fs::remove_all(dir); }
};

std::string with_text_data(std::string flags) {
  const auto at = flags.find("{text}");
  if (at == std::string::npos) return flags;
  static const TextData data;
  return flags.replace(at, 6, data.dir.string());
}

TEST_P(ExactResume, KilledMidEpochTwoAndRestartedEqualsStraightRun) {
  const std::string n = std::to_string(GetParam().processes);
  const std::string flags = " " + with_text_data(GetParam().strategy);
  TempDir straight("straight_" + GetParam().name), killed("killed_" + GetParam().name);
  auto a = run_command(cli_path() + " run --nproc-per-node " + n + " --master-port 0 --" + " " +
                       cli_path() + train_cmd(straight.path) + flags);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  // 6 steps per epoch: step 9 is in the middle of epoch 2; the newest checkpoint is step 8.
  auto b = run_command("SCALETRAIN_KILL_AT_STEP=9 " + cli_path() + " run --nproc-per-node " + n +
                       " --master-port 0 --max-restarts 1 -- " + cli_path() +
                       train_cmd(killed.path) + flags);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("was killed by SIGKILL"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
  // The final weights, byte for byte; and a one-file run's last checkpoint, tensor for tensor.
  EXPECT_TRUE(same_bytes(contents_of(killed.path).at("model.pt"),
                         contents_of(straight.path).at("model.pt")));
  // (ckpt-12.st with --checkpoint-format full.)
  const std::string last = fs::exists(straight.path / "ckpt-12") ? "ckpt-12" : "ckpt-12.st";
  if (fs::exists(straight.path / last)) {
    auto x = params_of((straight.path / last).string(), GetParam().model);
    auto y = params_of((killed.path / last).string(), GetParam().model);
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_TRUE(testing::bit_for_bit(y[i], x[i])) << "parameter " << i;
    }
  }
  // The resumed run's loss curve is the straight run's: the killed attempt's lines past the
  // checkpoint are dropped, and the redone steps log the same losses.
  EXPECT_EQ(step_lines(killed.path / "metrics.jsonl"), step_lines(straight.path / "metrics.jsonl"));
  // Regression (ResumedEpochLossCountsOnlyTheStepsAfterTheCheckpoint): the epoch's loss is the
  // whole epoch's mean, the steps before the checkpoint included (their sums are saved).
  EXPECT_EQ(step_lines(killed.path / "metrics.jsonl", "epoch"),
            step_lines(straight.path / "metrics.jsonl", "epoch"));
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ExactResume,
    ::testing::Values(
        Resume{"ddp1", 1, "--strategy ddp"}, Resume{"ddp2", 2, "--strategy ddp"},
        Resume{"dp", 1, "--strategy dp --devices cpu,cpu"},
        Resume{"pipeline", 1, "--strategy pipeline --devices cpu,cpu --schedule 1f1b --chunks 4"},
        Resume{"pipeline_interleaved", 1,
               "--strategy pipeline --devices cpu,cpu --schedule interleaved "
               "--stages-per-device 2 --chunks 4"},
        Resume{"pipeline_zb_h1", 1,
               "--strategy pipeline --devices cpu,cpu --schedule zb-h1 --chunks 4"},
        Resume{"grid", 4, "--strategy grid --pipeline-stages 2 --chunks 2"},
        Resume{"grid_interleaved", 2,
               "--strategy grid --pipeline-stages 2 --schedule interleaved "
               "--stages-per-device 2 --chunks 4"},
        Resume{"grid_zb_h1", 2, "--strategy grid --pipeline-stages 2 --schedule zb-h1 --chunks 4"},
        Resume{"zero1", 2, "--strategy zero1"}, Resume{"zero2", 2, "--strategy zero2"},
        Resume{"fsdp", 2, "--strategy fsdp"},
        Resume{"zero1_bf16", 2, "--strategy zero1 --amp bf16"},
        Resume{"fsdp_bf16", 2, "--strategy fsdp --amp bf16"},
        // Regression (DropoutBreaksExactResume): each rank's generators are in the checkpoint.
        Resume{"ddp1_dropout", 1, "--strategy ddp --model mlp --dropout 0.3", "mlp"},
        Resume{"ddp2_dropout", 2, "--strategy ddp --model mlp --dropout 0.3", "mlp"},
        Resume{"zero2_dropout", 2, "--strategy zero2 --model mlp --dropout 0.3", "mlp"},
        // --checkpoint-format sharded: a file per rank, nothing gathered, the same resume.
        Resume{"zero1_sharded", 2, "--strategy zero1 --checkpoint-format sharded"},
        // The other cases write the default format, a folder in PyTorch's DCP layout; these
        // write one file (--checkpoint-format full), gathered alike: Adam, a ZeRO optimizer,
        // a grid's stages, and the background writer.
        Resume{"ddp2_full", 2, "--strategy ddp --checkpoint-format full --optimizer adam"},
        Resume{"zero1_full", 2, "--strategy zero1 --checkpoint-format full"},
        Resume{"grid_full_async", 2,
               "--strategy grid --pipeline-stages 2 --chunks 2 --checkpoint-format full "
               "--async-checkpoint"},
        Resume{"fsdp_sharded", 2, "--strategy fsdp --checkpoint-format sharded --optimizer adam"},
        // Tensor parallelism: every rank's optimizer state in the checkpoint, the whole model's
        // weights under the GPT's names.
        Resume{"tp2_sequence_parallel", 2,
               "--strategy ddp --tp 2 --sequence-parallel --model gpt-tiny --dataset text "
               "--data-dir {text} --optimizer adam --max-grad-norm 1 --dropout 0.1",
               "gpt-tiny"},
        Resume{"dp2_tp2", 4,
               "--strategy ddp --tp 2 --model gpt-tiny --dataset text --data-dir {text}",
               "gpt-tiny"},
        // 2D ZeRO x TP: every rank's optimizer shard of its slices in rank 0's file.
        Resume{"zero2_tp2", 4,
               "--strategy zero2 --tp 2 --sequence-parallel --model gpt-tiny --dataset text "
               "--data-dir {text}",
               "gpt-tiny"},
        Resume{"fsdp_tp2", 4,
               "--strategy fsdp --tp 2 --model gpt-tiny --dataset text --data-dir {text} "
               "--optimizer adam",
               "gpt-tiny"},
        // 3D: a grid whose stages are split over tp (pp 2 x tp 2, and dp 2 x pp 2 x tp 2),
        // each stage's tp ranks' optimizer states in rank 0's file.
        Resume{"grid_tp2", 4,
               "--strategy grid --pipeline-stages 2 --tp 2 --sequence-parallel --chunks 2 "
               "--model gpt-tiny --dataset text --data-dir {text} --optimizer adam",
               "gpt-tiny"},
        Resume{"dp2_pp2_tp2", 8,
               "--strategy grid --pipeline-stages 2 --tp 2 --schedule 1f1b --chunks 2 "
               "--model gpt-tiny --dataset text --data-dir {text}",
               "gpt-tiny"},
        // Checkpoints written in the background: the kill at step 9 may come while step 8's
        // file is still being written (then the resume starts from step 6), and either way
        // the run ends as the straight one.
        Resume{"ddp2_async", 2, "--strategy ddp --async-checkpoint --optimizer adam"},
        Resume{"grid_async", 2,
               "--strategy grid --pipeline-stages 2 --chunks 2 --async-checkpoint"},
        Resume{"fsdp_sharded_async", 2,
               "--strategy fsdp --checkpoint-format sharded --async-checkpoint"}),
    [](const ::testing::TestParamInfo<Resume>& p) { return p.param.name; });

// Coordinated dropout (Note [Coordinated dropout] in zoo/gpt.cpp): a GPT with dropout split
// over tp 2 processes, with and without sequence parallelism, or with its sequences over cp 2,
// draws the single process's masks (a tensor-parallel or context-parallel group's ranks share
// one random stream), so its loss curve is the single
// process's to float32's rounding; without dropout the curve is another one. One epoch (6 steps):
// the runs are a numeric test, repeated at each CPU dispatch level.
TEST(Train, GptDropoutUnderTensorParallelDrawsTheSingleProcessMasks) {
  auto curve = [](int processes, const std::string& flags) {
    TempDir out("tp_dropout");
    auto r = run_command(
        cli_path() + " run --nproc-per-node " + std::to_string(processes) + " --master-port 0 -- " +
        cli_path() + train_cmd(out.path) +
        with_text_data(" --model gpt-tiny --dataset text --data-dir {text} --epochs 1 ") + flags);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return step_lines(out.path / "metrics.jsonl");
  };
  const auto one = curve(1, "--dropout 0.2");
  ASSERT_GE(one.size(), 4u);
  for (const auto& [processes, flags] :
       std::vector<std::pair<int, std::string>>{{2, "--dropout 0.2 --tp 2"},
                                                {2, "--dropout 0.2 --tp 2 --sequence-parallel"},
                                                {2, "--dropout 0.2 --cp 2"}}) {
    const auto split = curve(processes, flags);
    ASSERT_EQ(split.size(), one.size()) << flags;
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_NEAR(split[i].second, one[i].second, 1e-5 * one[i].second) << flags << ", step " << i;
    }
  }
  const auto plain = curve(1, "");
  ASSERT_EQ(plain.size(), one.size());
  EXPECT_GT(std::abs(plain.back().second - one.back().second), 1e-3) << "dropout drew no mask";
}

// Regression (ResumeAtAnotherDegreeSplitTheGroupsStreams): a GPT with dropout trained one epoch
// under ddp on 2 processes, then resumed for a second at tp 2 on the same 2: the tp group took
// its ranks' two saved streams, and drew different masks on its two ranks. The generators are
// restored only at the degree they were saved at; otherwise each group starts its stream from the
// step, so the second epoch is the one a single process resumed from the same file trains. The
// same for a cp group resumed from ddp's file.
TEST(Train, ResumeAtAnotherTensorParallelDegreeGivesTheGroupOneStream) {
  TempDir first("tp_streams");
  const std::string text =
      with_text_data(" --model gpt-tiny --dataset text --data-dir {text} --dropout 0.2 ") +
      "--momentum 0 ";  // no optimizer state, which another strategy's resume would drop
  auto launch = [&](int processes, const fs::path& out, const std::string& flags) {
    auto r = run_command(cli_path() + " run --nproc-per-node " + std::to_string(processes) +
                         " --master-port 0 -- " + cli_path() + train_cmd(out) + text + flags);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  };
  launch(2, first.path, "--epochs 1");
  std::map<std::string, std::vector<std::pair<int64_t, double>>> second;
  for (const auto& [processes, flags] :
       std::vector<std::pair<int, std::string>>{{1, "--tp 1"}, {2, "--tp 2"}, {2, "--cp 2"}}) {
    TempDir again("tp_streams" + std::to_string(processes));
    fs::copy(first.path, again.path,
             fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    launch(processes, again.path, "--epochs 2 " + flags);
    second[flags] = step_lines(again.path / "metrics.jsonl");
  }
  const auto& one = second["--tp 1"];
  ASSERT_EQ(one.size(), 12u);
  for (const std::string flags : {"--tp 2", "--cp 2"}) {  // a cp group shares a stream too
    ASSERT_EQ(second[flags].size(), one.size()) << flags;
    for (size_t i = 6; i < 12; ++i) {
      EXPECT_NEAR(second[flags][i].second, one[i].second, 1e-5 * one[i].second)
          << flags << ", step " << one[i].first;
    }
  }
}

// The same run with checkpoints written in the background gives the same files: every
// checkpoint holds the same weights, and model.pt is the same byte for byte.
TEST(Checkpoint, AsyncCheckpointsEqualSynchronousOnes) {
  TempDir sync("sync_ckpt"), async("async_ckpt");
  auto a = run_command(cli_path() + train_cmd(sync.path) + " --optimizer adam --keep 10");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_command(cli_path() + train_cmd(async.path) +
                       " --optimizer adam --keep 10 --async-checkpoint");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  // Steps 2, 4, ..., 12, and the ends of the two epochs (steps 6 and 12 again, past the epoch).
  EXPECT_NE(b.output.find("8 written in the background"), std::string::npos) << b.output;
  EXPECT_TRUE(
      same_bytes(contents_of(async.path).at("model.pt"), contents_of(sync.path).at("model.pt")));
  for (int step : {2, 4, 6, 8, 10, 12}) {
    const auto name = "ckpt-" + std::to_string(step);
    ASSERT_TRUE(fs::exists(async.path / name)) << name;
    auto x = params_of((sync.path / name).string()), y = params_of((async.path / name).string());
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(at::equal(x[i], y[i])) << name << " " << i;
  }
}

TEST(Checkpoint, TruncatedOrCorruptFilesAreSkipped) {
  TempDir dir("ckpt");
  Model m = make_model("lenet");
  torch::optim::SGD opt(m.module->parameters(), 0.1);
  TrainingState s;
  s.run_id = "test";
  s.model_name = "lenet";
  for (int64_t step : {1, 2, 3}) {
    s.global_step = step;
    save_checkpoint(dir.path.string(), s, *m.module, opt, 2);
  }
  EXPECT_FALSE(fs::exists(dir.path / "ckpt-1.st")) << "keep 2";
  // Damage the newest: cut it short.
  auto newest = dir.path / "ckpt-3.st";
  fs::resize_file(newest, fs::file_size(newest) - 10);
  EXPECT_NE(checkpoint_problem(newest.string())->find("truncated"), std::string::npos);
  EXPECT_EQ(newest_valid_checkpoint(dir.path.string()), (dir.path / "ckpt-2.st").string());
  // Flip a byte of the other: checksum mismatch.
  {
    std::fstream f(dir.path / "ckpt-2.st", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x42');
  }
  EXPECT_NE(checkpoint_problem((dir.path / "ckpt-2.st").string())->find("checksum"),
            std::string::npos);
  EXPECT_FALSE(newest_valid_checkpoint(dir.path.string()).has_value());
}

// A checkpoint holds the model under PyTorch's names whatever the strategy, and the optimizer's
// state as the standard optimizer's over them (Note [Standard optimizer state]): a run trained
// pipelined goes on under ddp, a grid's under dp and back under a grid, and ZeRO's under ddp
// and back, none starting its optimizer afresh.
// Regression (GridOptimizerStartedAfreshUnderAnotherStrategy): a grid kept each stage's
// optimizer as bytes of its own, so dp after a grid started its momentum again.
TEST(Train, CheckpointsMoveBetweenStrategies) {
  TempDir a("cross_pipeline"), b("cross_grid");
  const std::string common =
      " --device cpu --dataset synthetic --limit-train 256 --limit-test 64"
      " --batch-size 64 --no-progress --epochs ";
  auto first = run_command(cli_path() + " train" + common +
                           "1 --strategy pipeline --devices cpu,cpu --out " + a.path.string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto then =
      run_command(cli_path() + " train" + common + "2 --strategy ddp --out " + a.path.string());
  ASSERT_EQ(then.exit_code, 0) << then.output;
  EXPECT_NE(then.output.find("resumed from " + a.path.string() + "/ckpt-4 "), std::string::npos)
      << then.output;
  EXPECT_EQ(then.output.find("starts afresh"), std::string::npos) << then.output;
  EXPECT_TRUE(fs::exists(a.path / "ckpt-8" / ".metadata"));

  auto grid = run_command(cli_path() + " train" + common +
                          "1 --strategy grid --nproc-per-node 2 --pipeline-stages 2 --out " +
                          b.path.string());
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  auto dp = run_command(cli_path() + " train" + common +
                        "2 --strategy dp --devices cpu,cpu --out " + b.path.string());
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_NE(dp.output.find("resumed from " + b.path.string() + "/ckpt-4 "), std::string::npos)
      << dp.output;
  EXPECT_EQ(dp.output.find("starts afresh"), std::string::npos) << dp.output;
  auto grid_again = run_command(cli_path() + " train" + common +
                                "3 --strategy grid --nproc-per-node 2 --pipeline-stages 2 --out " +
                                b.path.string());
  ASSERT_EQ(grid_again.exit_code, 0) << grid_again.output;
  EXPECT_NE(grid_again.output.find("resumed from " + b.path.string() + "/ckpt-8 "),
            std::string::npos)
      << grid_again.output;
  EXPECT_EQ(grid_again.output.find("starts afresh"), std::string::npos) << grid_again.output;

  // ZeRO's sharded optimizer is saved as the model's own (Note [ZeRO's optimizer in
  // checkpoints]): ddp goes on with its momentum, and zero2 again at another world size.
  TempDir c("cross_zero");
  auto zero = run_command(cli_path() + " train" + common +
                          "1 --strategy zero2 --nproc-per-node 2 --out " + c.path.string());
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  auto ddp = run_command(cli_path() + " train" + common +
                         "2 --strategy ddp --nproc-per-node 1 --out " + c.path.string());
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_NE(ddp.output.find("resumed from " + c.path.string() + "/ckpt-4 "), std::string::npos)
      << ddp.output;
  EXPECT_EQ(ddp.output.find("starts afresh"), std::string::npos) << ddp.output;
  auto again = run_command(cli_path() + " train" + common +
                           "3 --strategy fsdp --nproc-per-node 2 --out " + c.path.string());
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.output.find("starts afresh"), std::string::npos) << again.output;
}

// Issue: pruning to --keep by step number deleted another run's newer... or this run's own
// checkpoints. Pruning keeps the newest `keep` of the same run and never touches another's.
TEST(Checkpoint, PruningTouchesOnlyItsOwnRun) {
  TempDir dir("ckpt_runs");
  Model m = make_model("toy");
  torch::optim::SGD opt(m.module->parameters(), 0.1);
  TrainingState s;
  s.model_name = "toy";
  s.run_id = "old";
  for (int64_t step : {100, 101, 102}) {
    s.global_step = step;
    save_checkpoint(dir.path.string(), s, *m.module, opt, 3);
  }
  s.run_id = "new";
  for (int64_t step : {1, 2, 3}) {
    s.global_step = step;
    save_checkpoint(dir.path.string(), s, *m.module, opt, 2);
  }
  for (int64_t step : {100, 101, 102, 2, 3}) {
    EXPECT_TRUE(fs::exists(dir.path / ("ckpt-" + std::to_string(step) + ".st"))) << step;
  }
  EXPECT_FALSE(fs::exists(dir.path / "ckpt-1.st"));
  EXPECT_EQ(checkpoint_run((dir.path / "ckpt-3.st").string()), "new");
  EXPECT_EQ(checkpoint_run((dir.path / "ckpt-100.st").string()), "old");
  s.run_id = "bad id/";
  EXPECT_THROW(save_checkpoint(dir.path.string(), s, *m.module, opt, 2), UsageError);
}

// Issue: `--resume none --out DIR` over a finished run deleted every checkpoint of the new run
// (pruned by step against the old run's higher steps), continued the old metrics.jsonl, and
// printed a checkpoint that no longer existed. Such a folder is refused, untouched; --overwrite
// deletes the old run's files first and the new run's files are its own.
TEST(Train, ReusedOutputFolderNeverLosesOrMixesRuns) {
  TempDir dir("reused");
  const std::string out = (dir.path / "run").string();
  auto a = run_command(cli_path() + train_cmd(out) + " --nproc-per-node 1" + " --keep 3");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto before = contents_of(out);
  ASSERT_TRUE(before.count("ckpt-12/.metadata")) << a.output;
  const std::string old_id = *checkpoint_run(out + "/ckpt-12");

  auto refused = run_command(cli_path() + train_cmd(out) + " --nproc-per-node 1" +
                             " --resume none --epochs 1 --keep 3");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("holds another run (ckpt-10, ckpt-12, ckpt-8 and "),
            std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("--overwrite"), std::string::npos) << refused.output;
  EXPECT_EQ(contents_of(out), before) << "a refused run changed the folder";

  auto fresh = run_command(cli_path() + train_cmd(out) + " --nproc-per-node 1" +
                           " --resume none --overwrite --epochs 1 --keep 3");
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  for (const char* gone : {"ckpt-8", "ckpt-10", "ckpt-12"}) {
    EXPECT_FALSE(fs::exists(out + "/" + gone)) << gone;
  }
  for (const char* kept : {"ckpt-2", "ckpt-4", "ckpt-6", "model.pt", "run.json"}) {
    EXPECT_TRUE(fs::exists(out + "/" + kept)) << kept;
  }
  EXPECT_NE(*checkpoint_run(out + "/ckpt-6"), old_id);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(out + "/run.json"))["run_id"],
            *checkpoint_run(out + "/ckpt-6"));
  auto lines = step_lines(out + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 6u) << "the old run's lines were kept";
  EXPECT_EQ(lines.front().first, 1);
  EXPECT_NE(fresh.output.find("checkpoint      " + out + "/ckpt-6"), std::string::npos)
      << fresh.output;
}

// Regression (TimeBalanceChangedOnResume): a grid started with one split and resumed with
// --balance auto (measured) keeps the checkpoint's split, so its stages keep their optimizer
// state: the final weights are those of the run never stopped. ("3,1" puts LeNet's three
// heaviest blocks on stage 0, a split the measurement does not choose.)
TEST(Train, GridResumeKeepsTheCheckpointsBalance) {
  TempDir straight("balance_straight"), stopped("balance_stopped");
  const std::string grid = " --strategy grid --pipeline-stages 2 --chunks 2";
  auto launch = [](const std::string& env, const fs::path& out, const std::string& flags) {
    return run_command(env + cli_path() + " run --nproc-per-node 2 --master-port 0 -- " +
                       cli_path() + train_cmd(out) + flags);
  };
  auto a = launch("", straight.path, grid + " --balance 3,1");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = launch("SCALETRAIN_KILL_AT_STEP=9 ", stopped.path, grid + " --balance 3,1");
  ASSERT_NE(b.exit_code, 0) << b.output;
  auto c = launch("", stopped.path, grid + " --balance auto");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from"), std::string::npos) << c.output;
  EXPECT_TRUE(same_bytes(contents_of(stopped.path).at("model.pt"),
                         contents_of(straight.path).at("model.pt")))
      << c.output;
}

// Regression (GridProgressLineShowedNaN): rank 0 of a grid is its first stage, which computes
// no loss; its progress lines printed "loss nan". They show the last stage's running mean.
TEST(Train, GridProgressLinesShowTheLastStagesLoss) {
  TempDir dir("grid_progress");
  auto r = run_command(cli_path() + " run --nproc-per-node 2 --master-port 0 -- " + cli_path() +
                       " train --device cpu --dataset synthetic --limit-train 384 --limit-test 64 "
                       "--epochs 1 --batch-size 64 --strategy grid --pipeline-stages 2 --out " +
                       dir.path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("6/6 batches, loss "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("loss nan"), std::string::npos) << r.output;
}

// A launcher's restart of the same run that died before its first checkpoint is that run
// starting over, not another run: it is not refused, and its metrics start again.
TEST(Train, RestartBeforeTheFirstCheckpointStartsOver) {
  TempDir dir("restart_early");
  auto r = run_command("SCALETRAIN_KILL_AT_STEP=2 " + cli_path() +
                       " run --nproc-per-node 1 --master-port 0 --max-restarts 1 -- " + cli_path() +
                       " train --device cpu --dataset synthetic --limit-train 256 --limit-test 64"
                       " --epochs 1 --batch-size 64 --log-every 1 --no-progress --out " +
                       dir.path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("was killed by SIGKILL"), std::string::npos) << r.output;
  auto lines = step_lines(dir.path / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(lines[static_cast<size_t>(i)].first, i + 1);
}

TEST(Checkpoint, AnotherModelIsRefused) {
  TempDir dir("ckpt_model");
  Model toy = make_model("toy");
  torch::optim::SGD opt(toy.module->parameters(), 0.1);
  TrainingState s;
  s.run_id = "test";
  s.model_name = "toy";
  auto path = save_checkpoint(dir.path.string(), s, *toy.module, opt, 1);
  Model lenet = make_model("lenet");
  torch::optim::SGD opt2(lenet.module->parameters(), 0.1);
  EXPECT_THROW(load_checkpoint(path, *lenet.module, opt2, "lenet"), UsageError);
}

struct Bad {
  std::string args, message;
};
class TrainBadInput : public ::testing::TestWithParam<Bad> {};

TEST_P(TrainBadInput, IsRefusedBeforeTraining) {
  auto r = run_command(cli_path() + " train --nproc-per-node 2 --no-progress " + GetParam().args);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(GetParam().message), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("epoch 1"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TrainBadInput,
    ::testing::Values(
        Bad{"--model resnet9000", "unknown model 'resnet9000'"},
        Bad{"--dataset imagenet", "unknown data set 'imagenet'"},
        Bad{"--batch-size 1",
            "--batch-size 1 does not split evenly over the 2 data-parallel replica(s)"},
        Bad{"--out /proc/scaletrain", "is not writable"},
        Bad{"--device tpu",
            "unknown --device 'tpu'; give cpu, cuda or cuda:N, or auto (a GPU when there is one)"},
        Bad{"--amp fp8", "unknown --amp 'fp8'"},
        Bad{"--workers -1", "--workers -1 must be from 0 (load on the training thread) to 256"},
        Bad{"--dataset folder --data-dir /nonexistent", "needs '/nonexistent/train'"},
        Bad{"--init-weights /nonexistent.pt", "--init-weights '/nonexistent.pt': no such file"},
        // Regression (NegativeSeedWrapsAround).
        Bad{"--seed -1", "--seed '-1' is not a whole number"},
        Bad{"--dropout 0.2", "--dropout is for --model mlp, gpt-tiny and gpt2-small"},
        Bad{"--context 32",
            "--context is for --model gpt-tiny, gpt2-small, llama-tiny or a Hugging Face"},
        Bad{"--strategy pipeline --devices cpu,cpu --model mlp --dropout 0.2 "
            "--checkpoint-activations always",
            "--dropout with --checkpoint-activations"},
        Bad{"--model mlp --dropout 1", "--dropout 1 must be in [0, 1)"},
        Bad{"--checkpoint-format sharded", "--checkpoint-format sharded is for the sharded"},
        Bad{"--checkpoint-format split", "unknown --checkpoint-format 'split'"}));

// Regression (BacktracesInsteadOfErrors): devices the machine lacks and models that cannot take
// the data died with a LibTorch backtrace after the workers started; now exit 2, the flag named.
INSTANTIATE_TEST_SUITE_P(
    BacktracesBecomeErrors, TrainBadInput,
    ::testing::Values(Bad{"--nproc-per-node 1 --strategy pipeline --devices cuda:7,cuda:8",
                          "--devices lists cuda:7, and this machine has"},
                      Bad{"--nproc-per-node 1 --strategy dp --devices cuda:7,cpu",
                          "--devices lists cuda:7, and this machine has"},
                      Bad{"--model toy --dataset synthetic",
                          "--model toy takes 10 numbers per sample"}));

// Issue: NaN options printed a LibTorch backtrace, --lr inf trained NaN weights, negative limits
// meant "all data", and --keep 0 / -1 and a folder as --init-weights were taken.
INSTANTIATE_TEST_SUITE_P(
    NonFiniteAndOutOfRangeValues, TrainBadInput,
    ::testing::Values(Bad{"--lr nan", "--lr nan must be a positive finite number"},
                      Bad{"--lr inf", "--lr inf must be a positive finite number"},
                      Bad{"--lr -0.1", "--lr -0.1 must be a positive finite number"},
                      Bad{"--momentum nan", "--momentum nan must be in [0, 1)"},
                      Bad{"--weight-decay nan", "--weight-decay nan must be 0 or a positive"},
                      Bad{"--gamma 0", "--gamma 0 must be a positive finite factor"},
                      Bad{"--limit-train -5", "--limit-train -5 must be 0 (every sample) or more"},
                      Bad{"--limit-test -1", "--limit-test -1 must be 0 (every sample) or more"},
                      Bad{"--keep 0", "--keep 0 must be at least 1"},
                      Bad{"--keep -1", "--keep -1 must be at least 1"},
                      Bad{"--eval-batch-size -4", "--eval-batch-size -4 must be 0 (the training"},
                      Bad{"--timeout 0", "--timeout 0 must be a positive number of seconds"},
                      Bad{"--init-weights /tmp", "--init-weights '/tmp' is a folder"}));

// Combinations that make no sense are refused before any work, with the reason.
INSTANTIATE_TEST_SUITE_P(
    StrategyCombinations, TrainBadInput,
    ::testing::Values(
        Bad{"--strategy dp --devices cpu,cpu", "runs in one process"},  // 2 processes given
        Bad{"--strategy ddp --devices cpu,cpu", "--devices is for dp and pipeline"},
        // The library names a strategy's own options one level down (pipeline.chunks); the
        // command line shows its flags.
        Bad{"--strategy ddp --chunks 4",
            "--chunks is for the pipeline strategies (pipeline, grid), not --strategy ddp"},
        // Regression (PipelineOptionAtItsDefaultPassedUnseen): a flag given at its default value
        // is named as any other.
        Bad{"--strategy ddp --schedule gpipe --checkpoint-activations never",
            "--schedule and --checkpoint-activations are for the pipeline strategies (pipeline, "
            "grid), not --strategy ddp"},
        Bad{"--strategy zero1 --pipeline-stages 2", "--pipeline-stages is for --strategy grid"},
        Bad{"--strategy pipeline --nproc-per-node 1 --balance 2,x",
            "--balance '2,x': 'x' is not a positive number of blocks"},
        Bad{"--strategy grid --pipeline-stages 3", "dividing the world: 2 processes, 3 stages"},
        Bad{"--strategy grid --pipeline-stages 2 --split-size 4", "a grid's stages take --chunks"},
        Bad{"--strategy ddp --pipeline-stages 4", "--pipeline-stages is for --strategy grid"},
        Bad{"--strategy tp",
            "unknown --strategy 'tp'; use ddp, dp, pipeline, grid, zero1, zero2 or fsdp"},
        Bad{"--strategy fsdp --devices cpu,cpu", "--devices is for dp and pipeline"},
        Bad{"--strategy zero1 --chunks 2", "--chunks is for the pipeline strategies"},
        Bad{"--strategy zero2 --amp fp16", "needs loss scaling, which the sharded strategies"},
        Bad{"--strategy grid --pipeline-stages 2 --amp fp16",
            "needs one loss scale agreed over every stage"},
        Bad{"--strategy fsdp --uneven-inputs join", "--uneven-inputs is for --strategy ddp"},
        Bad{"--schedule cosine", "the learning-rate schedule is --lr-schedule cosine"},
        Bad{"--nproc-per-node 4 --strategy grid --pipeline-stages 2 --schedule zb-h1",
            "--schedule zb-h1 across processes runs one pipeline (as many processes as "
            "--pipeline-stages, here 2, not 4)"},
        Bad{"--nproc-per-node 4 --strategy grid --pipeline-stages 2 --schedule interleaved "
            "--stages-per-device 2",
            "--schedule interleaved across processes runs one pipeline"},
        Bad{"--strategy grid --pipeline-stages 2 --schedule interleaved --stages-per-device 2 "
            "--chunks 3",
            "--chunks 3 on 2 devices; use a multiple of 2"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --schedule interleaved",
            "--schedule interleaved and --stages-per-device go together"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --stages-per-device 2",
            "--schedule interleaved and --stages-per-device go together"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --schedule interleaved "
            "--stages-per-device 2 --chunks 3",
            "--chunks 3 on 2 devices; use a multiple of 2"},
        Bad{"--strategy ddp --schedule interleaved --stages-per-device 2",
            "are for the pipeline strategies"},
        // Regression (interleaved balance): the list has devices x stages-per-device entries.
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --schedule interleaved "
            "--stages-per-device 2 --balance 2,2",
            "--balance '2,2' gives 2 stages; the pipeline has 4"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu", "at least 2 --devices"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --balance 1,1",
            "--balance '1,1' covers 2 blocks, and lenet has 4"},
        Bad{"--strategy pipeline --nproc-per-node 1 --devices cpu,cpu --balance 1,1,2",
            "--balance '1,1,2' gives 3 stages; the pipeline has 2"},
        Bad{"--strategy dp --nproc-per-node 1 --amp bf16",
            "runs with --strategy ddp (autocast), grid (bf16 autocast) and zero1, zero2, fsdp"},
        Bad{"--devices gpu0,cpu --strategy dp --nproc-per-node 1", "'gpu0' is not a device"}),
    [](const ::testing::TestParamInfo<Bad>& p) { return "combination" + std::to_string(p.index); });

// Issue: --nproc-per-node 0 and abc died of SIGFPE (exit 136, no message).
TEST(TrainBadNproc, ZeroOrNotANumberExitsTwoInsteadOfSigfpe) {
  for (const char* n : {"0", "abc", "-3"}) {
    auto r = run_command(cli_path() + " train --no-progress --nproc-per-node " + n);
    EXPECT_EQ(r.exit_code, 2) << n << "\n" << r.output;
    EXPECT_NE(r.output.find("--nproc-per-node"), std::string::npos) << r.output;
  }
}

// Note [Data on the device] and Note [Deferred reads]: --data-on-device gathers the loader's
// batches where the model trains, and ranks that read their steps' results in batches log what a
// run read step by step logs (the other run: an on_step hook on rank 0 makes every rank read
// each step): the same model.pt byte for byte, the same step and epoch lines. Log points (every
// 3) and the running mean's points (every 5 of 20 steps) fall on different steps.
TEST(Train, DataOnDeviceAndDeferredReadsGiveTheLoadersStepByStepRun) {
  TempDir eager("loader_eager"), deferred("device_deferred");
  const std::string common =
      " train --nproc-per-node 2 --device cpu --dataset synthetic --model mlp --limit-train 640"
      " --limit-test 64 --epochs 2 --batch-size 32 --log-every 3 --no-progress --out ";
  auto a =
      run_command("SCALETRAIN_KILL_AT_STEP=100000 " + cli_path() + common + eager.path.string());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_command(cli_path() + common + deferred.path.string() + " --data-on-device");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_TRUE(same_bytes(contents_of(deferred.path).at("model.pt"),
                         contents_of(eager.path).at("model.pt")));
  const auto steps = step_lines(eager.path / "metrics.jsonl");
  EXPECT_EQ(steps.size(), 2u * 20 / 3) << "a line every 3 of 40 steps";
  EXPECT_EQ(step_lines(deferred.path / "metrics.jsonl"), steps);
  EXPECT_EQ(step_lines(deferred.path / "metrics.jsonl", "epoch"),
            step_lines(eager.path / "metrics.jsonl", "epoch"));
  auto text = run_command(cli_path() + " train --model gpt-tiny --dataset text --data-dir " +
                          with_text_data("{text}") + " --data-on-device --out " +
                          (deferred.path / "text").string());
  EXPECT_EQ(text.exit_code, 2) << text.output;
  EXPECT_NE(text.output.find("--dataset text is read from files"), std::string::npos)
      << text.output;
}

// Regression (EvaluationBatchFollowsTheTrainingBatch): the evaluation took batches of at least
// 256 samples whatever the training batch. A language model's logits grow with the batch
// (batch x context x vocabulary): 256 windows of GPT-2 small are 53 GB of fp32 logits, where its
// training batch of 8 fit in 11 GB. The evaluation now takes the training batch per replica, or
// TrainerOptions::eval_batch_size. The mean loss is the same to the rounding of a sample's
// forward (its longest sums: the MLP's fan-ins 785 and 257, the 10 classes), which a batch of
// another size may order otherwise; the accuracy is not compared, as near-tied logits flip.
TEST(Train, EvaluationBatchFollowsTheTrainingBatch) {
  Dataset train_set = make_synthetic(64, 1, 28, 28, 10, 1);
  Dataset test_set = make_synthetic(300, 1, 28, 28, 10, 2);
  // One start for both runs (rank threads share the process's generator, so a model each
  // builds from a seed may draw in either order).
  torch::manual_seed(4);
  Model start = make_model("mlp");
  auto build = [&start] {
    Model m = make_model("mlp");
    torch::NoGradGuard no_grad;
    auto from = start.module->parameters();
    auto to = m.module->parameters();
    for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    return m;
  };
  auto run = [&](int64_t eval_batch, const std::string& name) {
    TempDir dir(name);
    std::vector<int64_t> rows;  // every evaluation batch's, on every rank
    std::mutex m;
    double loss = -1;
    auto errors = testing::run_ranks(2, [&](Dist& d) {
      TrainTask task;
      task.model = build;
      task.train_data = in_memory(train_set);
      task.test_data = in_memory(test_set);
      Metric counted = token_loss();
      auto inner = counted.per_sample;
      counted.per_sample = [&, inner](const at::Tensor& out, const at::Tensor& y) {
        std::lock_guard<std::mutex> lock(m);
        rows.push_back(out.size(0));
        return inner(out, y);
      };
      task.metrics = {counted};
      TrainerOptions o;
      o.epochs = 1;
      o.batch_size = 16;  // 8 per replica
      o.eval_batch_size = eval_batch;
      o.device = at::kCPU;
      o.progress = false;
      o.tensorboard = false;
      o.resume = scaletrain::Resume::none();
      o.out_dir = (dir.path / "out").string();
      auto r = train(task, o, d);
      if (d.rank() == 0) loss = r.metrics.at("test_loss");
    });
    EXPECT_EQ(errors, std::vector<std::string>(2));
    return std::make_pair(rows, loss);
  };
  const auto [by_default, loss_by_default] = run(0, "eval_default");
  ASSERT_EQ(by_default.size(), 2u * 19) << "150 samples per replica in batches of 8";
  for (int64_t r : by_default) EXPECT_LE(r, 8);
  const auto [set, loss_set] = run(50, "eval_set");
  ASSERT_EQ(set.size(), 2u * 3);
  for (int64_t r : set) EXPECT_EQ(r, 50);
  const double terms = 785 + 257 + 10 + 10;
  EXPECT_GT(loss_by_default, 0);
  EXPECT_NEAR(loss_set, loss_by_default, 4 * terms * std::ldexp(1.0, -24) * loss_by_default);
}

// Regression (CpuDevicesOnAGpuMachineAskedNccl): on a machine with one GPU, `--strategy dp
// --devices cpu,cpu` joined over NCCL and failed at its first collective of CPU tensors. The
// backend follows where the trainer's collectives live (the strategy's first device).
TEST(Train, CpuDevicesOnAGpuMachineAskedNcclAndNowGetGloo) {
  TrainOptions o;
  EXPECT_EQ(train_backend(o, "auto", 1), "auto") << "ddp on cuda:0 may take NCCL";
  EXPECT_EQ(train_backend(o, "auto", 0), "auto");
  o.device = at::kCPU;
  EXPECT_EQ(train_backend(o, "auto", 4), "gloo");
  EXPECT_EQ(train_backend(o, "nccl", 4), "nccl") << "asked for by name: the user's call";
  o.device.reset();
  o.strategy = Strategy::kDataParallel;
  o.devices = {at::kCPU, at::kCPU};
  EXPECT_EQ(train_backend(o, "auto", 1), "gloo");
  o.devices = {};
  EXPECT_EQ(train_backend(o, "auto", 1), "gloo") << "one GPU: dp's default devices are cpu,cpu";
  EXPECT_EQ(train_backend(o, "auto", 2), "auto") << "two GPUs: cuda:0,cuda:1";
  o.strategy = Strategy::kPipeline;
  o.devices = {at::Device("cuda:0"), at::kCPU};
  EXPECT_EQ(train_backend(o, "auto", 1), "auto");
  o.devices = {at::kCPU, at::Device("cuda:0")};
  EXPECT_EQ(train_backend(o, "auto", 1), "gloo");
}

// Regression (OneDeviceSyncPerParameter): the finite-gradients check copied each parameter's
// flag to the CPU on its own, one wait for the device per parameter. The flags are now one
// tensor on the first tensor's device, read once, with the same verdicts.
TEST(Train, OneDeviceSyncPerParameterIsOneFlag) {
  const auto ok = at::ones({3}), nan = at::full({2}, std::nan("")),
             inf = at::full({1}, std::numeric_limits<float>::infinity());
  EXPECT_TRUE(all_finite_flag({}).item<bool>());
  EXPECT_TRUE(all_finite_flag({ok, at::Tensor(), ok}).item<bool>());
  EXPECT_FALSE(all_finite_flag({ok, nan}).item<bool>());
  EXPECT_FALSE(all_finite_flag({inf, ok}).item<bool>());
  EXPECT_EQ(all_finite_flag({ok, ok}).dim(), 0);
  EXPECT_EQ(all_finite({ok, nan}), false);
  EXPECT_EQ(all_finite({ok}), true);
}

// Issue: --lr inf trained to the end and wrote a model.pt of NaN weights. A run whose gradients
// turn non-finite stops at that step on every rank, naming it and the last checkpoint, and
// writes nothing more: every file it leaves holds finite weights.
TEST(Train, NonFiniteLossStopsNamingTheStepAndTheLastCheckpoint) {
  TempDir dir("diverge");
  auto r = run_command(cli_path() +
                       " train --nproc-per-node 2 --device cpu --dataset synthetic --limit-train "
                       "256 --limit-test 64 --batch-size 64 --epochs 2 --lr 1e30 --no-progress "
                       "--checkpoint-every 1 --keep 5 --out " +
                       dir.path.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("training diverged at step 2 (epoch 1)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find((dir.path / "ckpt-1").string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir.path / "model.pt"));
  EXPECT_FALSE(fs::exists(dir.path / "ckpt-2"));
  for (auto& p : params_of((dir.path / "ckpt-1").string())) {
    EXPECT_TRUE(at::isfinite(p).all().item<bool>());
  }
}

// Regression (OneRankReadEachStepTheOthersRanOn): with an on_step hook on rank 0 alone, rank 0
// read every step and stopped at the bad one while rank 1 deferred its check and went on into
// the next step's collectives, so the run ended in a lost-peer error or the collective timeout
// instead of the divergence (32 steps an epoch: rank 1's first reading was at step 8). The ranks
// now agree to read every step: both stop, naming it.
TEST(Train, DivergenceWithAHookOnOneRankStopsEveryRankAtTheStep) {
  TempDir dir("diverge_hook");
  auto r = run_command("SCALETRAIN_KILL_AT_STEP=100000 " + cli_path() +
                           " train --nproc-per-node 2 --device cpu --dataset synthetic "
                           "--limit-train 2048 --limit-test 64 --batch-size 64 --epochs 2 --lr "
                           "1e30 --no-progress --timeout 60 --out " +
                           dir.path.string(),
                       100);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("rank 0: training diverged at step 2 (epoch 1)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 1: training diverged at step 2 (epoch 1)"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
}

// Issue: a SIGINT'd `scaletrain train` exited 130 silently. It says so, and where to resume.
TEST(Train, InterruptedRunSaysWhereTheLastCheckpointIs) {
  TempDir dir("interrupt");
  const std::string ckpt = (dir.path / "ckpt-2" / ".metadata").string();  // once renamed in
  auto r = run_command(cli_path() +
                       " train --device cpu --dataset synthetic --limit-train 4096 --limit-test 64"
                       " --epochs 5 --batch-size 64 --checkpoint-every 2 --no-progress --out " +
                       dir.path.string() + " & t=$!; for i in $(seq 600); do [ -f " + ckpt +
                       " ] && break; sleep 0.05; done; kill -INT $t; wait $t");
  EXPECT_EQ(r.exit_code, 130) << r.output;
  EXPECT_NE(r.output.find("interrupted by SIGINT"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("interrupted; the last checkpoint is " + dir.path.string() + "/ckpt-"),
            std::string::npos)
      << r.output;
}

// Issue: the collective timeout had no flag, so a lost rank took 5 minutes to surface. With
// --timeout 3, a rank stopped (SIGSTOP, as a partition looks from the others) is named within
// seconds.
TEST(Train, TimeoutFlagBoundsTheWaitForALostRank) {
  TempDir dir("timeout");
  const std::string metrics = (dir.path / "metrics.jsonl").string();
  // Rank 1's process: the one whose environment says RANK=1 and whose command is `train`.
  const std::string find_rank1 =
      "for p in $(pgrep -f ' train --timeout'); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null"
      " | grep -qx RANK=1 && echo $p; done";
  auto r = run_command(
      cli_path() +
          " train --timeout 3 --nproc-per-node 2 --device cpu --dataset synthetic"
          " --limit-train 65536 --limit-test 64 --batch-size 64 --epochs 1 --log-every 1"
          " --no-progress --out " +
          dir.path.string() + " & t=$!; for i in $(seq 600); do [ -s " + metrics +
          " ] && break; sleep 0.05; done; victim=$(" + find_rank1 +
          "); kill -STOP $victim; start=$(date +%s); wait $t; status=$?;"
          " echo \"waited $(( $(date +%s) - start )) s\"; kill -KILL $victim 2>/dev/null; exit "
          "$status",
      120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("timed out after 3 s"), std::string::npos) << r.output;
  // Regression (TimeoutHintNamesTheLibraryOption): the hint names the flag a user of the tool has.
  EXPECT_NE(r.output.find("--timeout SECONDS"), std::string::npos) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("waited ([0-9]+) s"))) << r.output;
  EXPECT_LE(std::stoi(m[1].str()), 20) << r.output;  // 3 s, a grace period, a loaded machine
}

// Issue: two ranks of `scaletrain train` with different --limit-train (or --batch-size) hung
// for the 300 s collective timeout: the rank that ran out went on to evaluate()'s all-reduce
// while the other waited in the next step's uneven-input check. A rank that runs out of batches
// now joins at the end of its epoch, and every rank fails within seconds, naming the ranks.
TEST(Train, UnevenInputsMidEpochFailWithinSecondsInsteadOfHanging) {
  TempDir dir("uneven");
  int run = 0;
  for (const char* differ :
       {"--batch-size 32 --limit-train 128|--batch-size 32 --limit-train 256",
        "--limit-train 256 --batch-size 64|--limit-train 256 --batch-size 32"}) {
    const std::string d = differ;
    const std::string rank0 = d.substr(0, d.find('|')), rank1 = d.substr(d.find('|') + 1);
    auto r = run_command(cli_path() + " run --nproc-per-node 2 --master-port 0 -- " +
                             testing::script_path("rank_args.sh") + " '" + rank0 + "' '" + rank1 +
                             "' " + cli_path() +
                             " train --device cpu --dataset synthetic --limit-test 64 --epochs 2"
                             " --no-progress --resume none --out " +
                             (dir.path / std::to_string(run++)).string(),
                         120);
    EXPECT_NE(r.exit_code, 0) << differ << "\n" << r.output;
    EXPECT_LT(r.seconds, 60) << differ << ": took " << r.seconds << " s\n" << r.output;
    EXPECT_NE(r.output.find("uneven inputs"), std::string::npos) << differ << "\n" << r.output;
  }
}

TEST(Train, LearnsOnRealFashionMnistSubset) {
  if (!fs::exists(std::string("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  TempDir dir("fmnist");
  TrainOptions o;
  o.limit_train = 6144;
  o.limit_test = 1000;
  o.epochs = 3;
  o.progress = false;
  o.device = at::kCPU;  // rank threads share one process: CUDA needs processes
  o.out_dir = dir.path.string();
  o.resume = scaletrain::Resume::none();
  TrainResult r;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    auto mine = train(o, d);
    if (d.rank() == 0) r = mine;
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  // Ranks as threads share the global generator, so initial weights (rank 0's, broadcast)
  // vary between runs: 72 steps reach 0.6-0.75; chance is 0.1.
  EXPECT_GT(r.test_accuracy, 0.5);
  EXPECT_EQ(r.global_step, 3 * 24);
  std::ifstream metrics(r.metrics_path);
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  EXPECT_NE(last.find("\"kind\":\"epoch\""), std::string::npos) << last;
  EXPECT_NE(last.find("\"test_accuracy\""), std::string::npos) << last;
  EXPECT_EQ(r.device, "cpu");
  EXPECT_GT(r.peak_memory_bytes, 50 << 20);  // at least the data set (47 MB of floats)
  // TensorBoard's reader finds the same epochs in the event file.
  auto tb = run_command(std::string(VENV_DIR) + "/bin/python " +
                        testing::script_path("read_tfevents.py") + " " + dir.path.string() +
                        " 2>/dev/null");
  ASSERT_EQ(tb.exit_code, 0) << tb.output;
  auto acc = nlohmann::json::parse(tb.output.substr(tb.output.find('{')))["epoch/test_accuracy"];
  ASSERT_EQ(acc.size(), 3u) << tb.output;
  EXPECT_EQ(acc[2][0].get<int64_t>(), 72);
  EXPECT_EQ(acc[2][1].get<double>(), static_cast<float>(r.test_accuracy));  // a float32 scalar
}

// One rank (a thread), synthetic data: the options every test below starts from.
TrainOptions small(const fs::path& out) {
  TrainOptions o;
  o.dataset = "synthetic";
  o.limit_train = 512;
  o.limit_test = 128;
  o.epochs = 1;
  o.batch_size = 64;
  o.progress = false;
  o.out_dir = out.string();
  o.resume = scaletrain::Resume::none();
  o.device = at::kCPU;  // bitwise comparisons: CPU kernels, also where a GPU is present
  return o;
}

TrainResult train_alone(const TrainOptions& o) {
  TrainResult r;
  auto errors = testing::run_ranks(1, [&](Dist& d) { r = train(o, d); });
  EXPECT_EQ(errors, (std::vector<std::string>{""}));
  return r;
}

std::map<std::string, at::Tensor> weights_of(const std::string& path, const std::string& model,
                                             ModelOptions mo = {}) {
  Model m = make_model(model, mo);
  load_weights(path, *m.module);
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.module->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// Batches built on loader threads are the batches built inline: the same weights, bitwise.
TEST(Train, LoaderThreadsDoNotChangeTheResult) {
  TempDir a("workers0"), b("workers3");
  auto o = small(a.path);
  o.workers = 0;
  auto ra = train_alone(o);
  o = small(b.path);
  o.workers = 3;
  auto rb = train_alone(o);
  ASSERT_EQ(ra.global_step, 8);
  auto wa = weights_of(ra.weights_path, "lenet"), wb = weights_of(rb.weights_path, "lenet");
  for (auto& [k, v] : wa) EXPECT_TRUE(at::equal(v, wb[k])) << k;
}

TEST(Train, InitWeightsStartFromAStateDict) {
  TempDir dir("init");
  torch::manual_seed(42);
  Model start = make_model("lenet");
  const std::string w = (dir.path / "start.pt").string();
  save_weights(w, *start.module);
  auto o = small(dir.path / "run");
  o.init_weights = w;
  // A step of lr 1e-30 moves a weight w by 1e-30·|g|, below half an ulp of w (2^-25·|w|) unless
  // |w| < 1e-22·|g|: the result is the start, bit for bit.
  o.lr = 1e-30;
  o.momentum = 0;
  o.weight_decay = 0;
  auto r = train_alone(o);
  auto got = weights_of(r.weights_path, "lenet");
  for (auto& p : start.module->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), got[p.key()])) << p.key();
  }
}

// bf16 autocast on the CPU: the run learns (MLP on real data) and differs from the fp32 run,
// which shows that autocast was on.
TEST(Train, Bf16AutocastLearns) {
  if (!fs::exists(std::string("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  TempDir a("fp32"), b("bf16");
  auto o = small(a.path);
  o.dataset = "fashion-mnist";
  o.model = "mlp";
  o.limit_train = 4096;
  o.limit_test = 1000;
  auto r32 = train_alone(o);
  o.out_dir = b.path.string();
  o.amp = Amp::kBf16;
  auto r16 = train_alone(o);
  EXPECT_GT(r16.test_accuracy, 0.6);
  EXPECT_NEAR(r16.test_accuracy, r32.test_accuracy, 0.05);
  auto w32 = weights_of(r32.weights_path, "mlp"), w16 = weights_of(r16.weights_path, "mlp");
  EXPECT_FALSE(at::equal(w32["fc1.weight"], w16["fc1.weight"]));
}

// An ImageNet-style folder end to end: classes from the folder names, RGB crops into LeNet.
TEST(Train, ImageFolderEndToEnd) {
  TempDir dir("folder");
  for (const char* split : {"train", "val"}) {
    for (int c = 0; c < 2; ++c) {
      const fs::path d = dir.path / "data" / split / (c == 0 ? "red" : "blue");
      fs::create_directories(d);
      for (int i = 0; i < 8; ++i) {
        std::vector<unsigned char> px(36 * 36 * 3, 0);
        for (size_t k = 0; k < px.size(); k += 3)
          px[k + (c == 0 ? 0 : 2)] = static_cast<unsigned char>(150 + 10 * i);
        std::ofstream f(d / ("img" + std::to_string(i) + ".ppm"), std::ios::binary);
        f << "P6\n36 36\n255\n";
        f.write(reinterpret_cast<const char*>(px.data()), static_cast<std::streamsize>(px.size()));
      }
    }
  }
  auto o = small(dir.path / "run");
  o.dataset = "folder";
  o.data_dir = (dir.path / "data").string();
  o.image_size = 28;
  o.batch_size = 4;
  o.epochs = 2;
  o.workers = 2;
  auto r = train_alone(o);
  EXPECT_EQ(r.global_step, 2 * 4);
  ModelOptions mo;
  mo.in_channels = 3;
  mo.num_classes = 2;
  auto w = weights_of(r.weights_path, "lenet", mo);  // throws unless 3 channels and 2 classes
  EXPECT_EQ(w["fc2.weight"].size(0), 2);
}

// Seed 002's job, small: a pipelined ResNet over an image folder (generated here), SGD with a
// step schedule, a checkpoint every epoch, killed in epoch 2 and resumed — the same weights as
// the run never killed, and the learning rate decayed at the epoch.
TEST(SeedJobs, Seed002PipelinedResNetOnAnImageFolderKilledAndResumed) {
  TempDir dir("seed002");
  for (const char* split : {"train", "val"}) {
    for (int c = 0; c < 2; ++c) {
      const fs::path d = dir.path / "data" / split / (c == 0 ? "n01" : "n02");
      fs::create_directories(d);
      for (int i = 0; i < (std::string(split) == "train" ? 8 : 4); ++i) {
        std::vector<unsigned char> px(40 * 40 * 3);
        for (size_t k = 0; k < px.size(); ++k)
          px[k] =
              static_cast<unsigned char>((k * (c + 1) * 37 + static_cast<size_t>(i) * 11) % 256);
        std::ofstream f(d / ("img" + std::to_string(i) + ".ppm"), std::ios::binary);
        f << "P6\n40 40\n255\n";
        f.write(reinterpret_cast<const char*>(px.data()), static_cast<std::streamsize>(px.size()));
      }
    }
  }
  const std::string job =
      " train --strategy pipeline --devices cpu,cpu --schedule 1f1b --chunks 2 --model resnet50"
      " --dataset folder --data-dir " +
      (dir.path / "data").string() +
      " --image-size 32 --batch-size 8 --epochs 2 --lr 0.1 --lr-schedule step --step-size 1"
      " --gamma 0.1 --log-every 1 --workers 2 --no-progress --out ";
  auto a = run_command(cli_path() + " run --nproc-per-node 1 --master-port 0 -- " + cli_path() +
                           job + (dir.path / "straight").string(),
                       600);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("device          cpu: "), std::string::npos) << a.output;
  // 16 images, 2 steps an epoch: step 3 is in epoch 2, after the checkpoint of epoch 1.
  auto b = run_command("SCALETRAIN_KILL_AT_STEP=3 " + cli_path() +
                           " run --nproc-per-node 1 --master-port 0 --max-restarts 1 -- " +
                           cli_path() + job + (dir.path / "killed").string(),
                       600);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
  ModelOptions mo;
  mo.in_channels = 3;
  mo.num_classes = 2;
  auto x = weights_of((dir.path / "straight" / "model.pt").string(), "resnet50", mo);
  auto y = weights_of((dir.path / "killed" / "model.pt").string(), "resnet50", mo);
  for (auto& [k, v] : x) EXPECT_TRUE(at::equal(v, y[k])) << k;
  std::ifstream metrics(dir.path / "killed" / "metrics.jsonl");
  std::vector<double> lrs;
  for (std::string line; std::getline(metrics, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") lrs.push_back(j["lr"].get<double>());
  }
  EXPECT_EQ(lrs, (std::vector<double>{0.1, 0.1, 0.1 * 0.1, 0.1 * 0.1}));
}

// Seed 003's two-device run, small: ResNet-18 (small-image) with DataParallel over two devices,
// batch 512 and lr 0.2 as the seed has it; the summary gives each device's parameters and memory.
TEST(SeedJobs, Seed003ResNet18DataParallelOverTwoDevices) {
  TempDir dir("seed003");
  auto r =
      run_command(cli_path() +
                      " train --strategy dp --devices cpu,cpu --model resnet18 --batch-size 512"
                      " --lr 0.2 --dataset synthetic --limit-train 512 --limit-test 128"
                      " --epochs 1 --no-progress --out " +
                      dir.path.string(),
                  600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--strategy dp, 1 process(es)"), std::string::npos) << r.output;
  // Two replicas of the small-image ResNet-18, 11,172,810 parameters each (models_test).
  size_t devices = 0;
  for (size_t pos = 0;
       (pos = r.output.find("device          cpu: 11172810 parameters", pos)) != std::string::npos;
       ++pos) {
    ++devices;
  }
  EXPECT_EQ(devices, 2u) << r.output;
}

}  // namespace
}  // namespace scaletrain

namespace scaletrain {
namespace {

// A checkpoint holds the program's own state beside the model's: named tensors (a GradScaler's
// scale, the random generators) and named strings, and they come back as they were.
TEST(Checkpoint, HoldsTheProgramsOwnStateAndTheRandomGenerators) {
  TempDir dir("ckpt_extra");
  Model m = make_model("toy");
  torch::optim::SGD opt(m.module->parameters(), 0.1);
  GradScalerOptions so;
  so.init_scale = 1024;
  GradScaler scaler(so);
  scaler.scale(at::ones({1}));
  scaler.update();  // a first step: the growth tracker counts 1
  TrainingState s;
  s.run_id = "extra";
  s.model_name = "toy";
  for (const auto& [k, t] : scaler.state()) s.tensors["scaler/" + k] = t;
  for (const auto& [k, t] : rng_state()) s.tensors[k] = t;
  s.values["scheduler"] = R"({"last_epoch": 7})";
  const auto path = save_checkpoint(dir.path.string(), s, *m.module, opt, 1);
  const auto expected = at::randn({5});  // what the generator draws next after the save

  Model m2 = make_model("toy");
  torch::optim::SGD opt2(m2.module->parameters(), 0.1);
  auto loaded = load_checkpoint(path, *m2.module, opt2, "toy");
  EXPECT_EQ(loaded.values, s.values);
  ASSERT_EQ(loaded.tensors.size(), s.tensors.size());
  for (const auto& [k, t] : s.tensors) EXPECT_TRUE(at::equal(loaded.tensors[k], t)) << k;
  restore_rng(loaded.tensors);
  EXPECT_TRUE(at::equal(at::randn({5}), expected)) << "the generator continues where it was";
  GradScaler other(so);
  std::map<std::string, at::Tensor> scaler_state;
  for (const auto& [k, t] : loaded.tensors) {
    if (k.rfind("scaler/", 0) == 0) scaler_state[k.substr(7)] = t;
  }
  other.load_state(scaler_state);
  EXPECT_EQ(other.current_scale(), scaler.current_scale());
  EXPECT_TRUE(at::equal(other.state()["growth_tracker"], scaler.state()["growth_tracker"]));
}

// Issue: a checkpoint of a model with other shapes surfaced c10's raw message. Every load error
// names the file and the key, in the library's words.
TEST(Checkpoint, LoadErrorsNameTheFileAndTheKey) {
  TempDir dir("ckpt_key");
  ModelOptions wide;
  wide.hidden = 64;
  Model a = make_model("mlp", wide);
  torch::optim::SGD opt(a.module->parameters(), 0.1);
  TrainingState s;
  s.run_id = "k";
  s.model_name = "mlp";
  const auto path = save_checkpoint(dir.path.string(), s, *a.module, opt, 1);
  Model b = make_model("mlp");  // hidden 256
  torch::optim::SGD opt2(b.module->parameters(), 0.1);
  try {
    load_checkpoint(path, *b.module, opt2, "mlp");
    FAIL();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("checkpoint '" + path +
                       "': 'model.fc1.weight' is [64, 784] in the file "
                       "and [256, 784] in the model"),
              std::string::npos)
        << msg;
  }
  try {
    load_checkpoint(path, *b.module, opt2, "lenet");
    FAIL();
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("holds a 'mlp' model, not a 'lenet' one"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("--"), std::string::npos) << "no command-line wording: " << msg;
  }
}

}  // namespace
}  // namespace scaletrain
