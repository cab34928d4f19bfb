// Faults found by trying the trainer as a new user and as an adversary would: each test is named
// after the fault it pins, and fails without its fix.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "runtime/atomic_file.h"
#include "scaletrain/blocks.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/rng.h"
#include "scaletrain/trainer.h"
#include "scaletrain/zero.h"
#include "support/net.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "train/run_folder.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::run_command;

using testing::TempDir;

using testing::net_model;
using testing::NetImpl;

// ---- A resume at another world size trains each sample of the epoch once ---------------------

struct WorldChange {
  std::string name;
  Strategy before;
  int world_before;
  Strategy after;
  int world_after;
  CheckpointFormat format = CheckpointFormat::kFull;  // the first run's
};
void PrintTo(const WorldChange& c, std::ostream* os) { *os << c.name; }

TrainerOptions options_for(Strategy s, const std::string& out) {
  TrainerOptions o;
  o.strategy = s;
  o.epochs = 1;
  o.batch_size = 12;
  o.checkpoint_every = 1;
  o.keep = 10;
  o.out_dir = out;
  o.progress = false;
  o.tensorboard = false;
  o.log_every = 0;
  o.workers = 0;
  o.channels_last = false;
  // Regression (RankThreadsSharedTheGpu): on a GPU machine "auto" put every rank thread on
  // cuda:0, where their backwards queue on CUDA's one autograd thread and DDP's hooks wait for
  // each other until the collective timeout. Rank threads train on the CPU.
  o.device = at::kCPU;
  if (s == Strategy::kDataParallel || s == Strategy::kPipeline) o.devices = {at::kCPU, at::kCPU};
  if (s == Strategy::kPipeline || s == Strategy::kGrid) o.pipeline.chunks = 2;
  return o;
}

class ResumeAtAnotherWorldSize : public ::testing::TestWithParam<WorldChange> {};

// Regression (ResumeAtAnotherWorldSizeTrainsWrongSamples): the sampler's position was each rank's
// own count, so 2 -> 1 trained a quarter of the epoch twice and 1 -> 2 skipped samples. The
// samples are tagged by index (the target is the index; the loss records it and learns index % 3):
// the steps before the checkpoint and the resumed run's together see each sample exactly once.
TEST_P(ResumeAtAnotherWorldSize, EachSampleOfTheEpochIsTrainedOnce) {
  const WorldChange c = GetParam();
  constexpr int64_t kSamples = 48;  // 4 steps of 12 at every world size of the cases
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  Dataset data;
  data.inputs = at::randn({kSamples, 6}, gen);
  data.targets = at::arange(kSamples, at::kLong);
  data.num_classes = 3;
  TempDir dir("world_" + c.name);
  std::mutex mu;
  std::map<int64_t, int> seen;
  int64_t final_step = -1;
  auto task_of = [&] {
    TrainTask task;
    task.train_data = in_memory(data);
    task.model = [&] { return net_model(mu); };
    task.loss = [&](const at::Tensor& out, const at::Tensor& y) {
      {
        std::lock_guard<std::mutex> lock(mu);
        auto ys = y.cpu();
        for (int64_t i = 0; i < ys.numel(); ++i) ++seen[ys[i].item<int64_t>()];
      }
      return torch::nn::functional::cross_entropy(out, y.remainder(3));
    };
    return task;
  };
  // The first run stops (on every rank at once) right after the checkpoint of step 2.
  auto first = testing::run_ranks(c.world_before, [&](Dist& d) {
    TrainTask task = task_of();
    task.on_step = [](const StepReport& r) {
      if (r.global_step == 2) throw std::runtime_error("stopped at step 2");
    };
    TrainerOptions o = options_for(c.before, dir.path.string());
    o.checkpoint_format = c.format;
    train(task, o, d);
  });
  for (const auto& e : first) ASSERT_EQ(e, "stopped at step 2");
  ASSERT_TRUE(c.format == CheckpointFormat::kSharded || fs::exists(dir.path / "ckpt-2.st"));
  std::map<int64_t, int> before = seen;
  auto second = testing::run_ranks(c.world_after, [&](Dist& d) {
    auto r = train(task_of(), options_for(c.after, dir.path.string()), d);
    if (d.rank() == 0) final_step = r.global_step;
  });
  for (const auto& e : second) ASSERT_EQ(e, "");
  EXPECT_EQ(final_step, kSamples / 12) << "the epoch's steps, whatever the world";
  ASSERT_EQ(static_cast<int64_t>(seen.size()), kSamples);
  for (const auto& [index, count] : seen) {
    EXPECT_EQ(count, 1) << "sample " << index << " (" << before[index] << " before the resume)";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, ResumeAtAnotherWorldSize,
    ::testing::Values(WorldChange{"ddp_2_to_1", Strategy::kDDP, 2, Strategy::kDDP, 1},
                      WorldChange{"ddp_1_to_2", Strategy::kDDP, 1, Strategy::kDDP, 2},
                      WorldChange{"ddp_2_to_3", Strategy::kDDP, 2, Strategy::kDDP, 3},
                      WorldChange{"zero1_2_to_1", Strategy::kZero1, 2, Strategy::kZero1, 1},
                      WorldChange{"zero1_1_to_2", Strategy::kZero1, 1, Strategy::kZero1, 2},
                      WorldChange{"zero2_2_to_1", Strategy::kZero2, 2, Strategy::kZero2, 1},
                      WorldChange{"zero2_1_to_2", Strategy::kZero2, 1, Strategy::kZero2, 2},
                      WorldChange{"fsdp_2_to_1", Strategy::kFsdp, 2, Strategy::kFsdp, 1},
                      WorldChange{"fsdp_1_to_2", Strategy::kFsdp, 1, Strategy::kFsdp, 2},
                      WorldChange{"grid_2x2_to_1x2", Strategy::kGrid, 4, Strategy::kGrid, 2},
                      WorldChange{"grid_1x2_to_2x2", Strategy::kGrid, 2, Strategy::kGrid, 4},
                      WorldChange{"ddp_2_to_dp", Strategy::kDDP, 2, Strategy::kDataParallel, 1},
                      WorldChange{"ddp_2_to_pipeline", Strategy::kDDP, 2, Strategy::kPipeline, 1},
                      WorldChange{"pipeline_to_ddp_2", Strategy::kPipeline, 1, Strategy::kDDP, 2},
                      WorldChange{"fsdp_sharded_2_to_1", Strategy::kFsdp, 2, Strategy::kFsdp, 1,
                                  CheckpointFormat::kSharded},
                      WorldChange{"zero2_sharded_1_to_2", Strategy::kZero2, 1, Strategy::kZero1, 2,
                                  CheckpointFormat::kSharded}),
    [](const ::testing::TestParamInfo<WorldChange>& p) { return p.param.name; });

// ---- Two runs in one folder ------------------------------------------------------------------

TrainTask small_task(std::mutex& mu) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  Dataset data;
  data.inputs = at::randn({24, 6}, gen);
  data.targets = at::randint(3, {24}, gen, at::kLong);
  data.num_classes = 3;
  TrainTask task;
  task.train_data = in_memory(data);
  task.model = [&mu] { return net_model(mu); };
  return task;
}

// Regression (TwoRunsShareAFolder): a second run in a live run's folder trained beside it (with
// --resume auto it took the live run's checkpoint). The live run owns the folder; the second is
// refused, naming its process and host.
TEST(FolderOwner, ASecondRunIsRefusedNamingTheLiveOne) {
  TempDir dir("owner");
  std::mutex mu;
  FolderLock live(dir.path.string());
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    train(small_task(mu), options_for(Strategy::kDDP, dir.path.string()), d);
  });
  EXPECT_NE(errors[0].find("is in use by a live run (process " + std::to_string(getpid())),
            std::string::npos)
      << errors[0];
  EXPECT_FALSE(fs::exists(dir.path / "run.json")) << "the refused run wrote nothing";
  EXPECT_TRUE(FolderLock::holder(dir.path.string()).has_value());
}

TEST(FolderOwner, TheLockIsHeldForTheRunAndReleasedAfter) {
  TempDir dir("owner_during");
  std::mutex mu;
  bool checked = false;
  std::optional<std::string> during;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    TrainTask task = small_task(mu);
    task.on_step = [&](const StepReport&) {
      if (!checked) during = FolderLock::holder(dir.path.string());
      checked = true;
    };
    train(task, options_for(Strategy::kDDP, dir.path.string()), d);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_TRUE(checked && during.has_value()) << "held while the run trains";
  EXPECT_NE(during->find("process " + std::to_string(getpid())), std::string::npos) << *during;
  EXPECT_FALSE(FolderLock::holder(dir.path.string()).has_value()) << "released when train returns";
}

// Regression (OwnerCheckRacesTheOwner): the check every rank runs took the lock for a moment, and
// rank 0 of the same run, taking it then, was refused ("in use by a live run (another process)").
// A check takes nothing: an owner racing any number of checks always gets its lock.
TEST(FolderOwner, ACheckNeverMakesTheOwnersLockFail) {
  TempDir dir("owner_race");
  std::atomic<bool> done{false};
  std::thread checker([&] {
    while (!done) FolderLock::holder(dir.path.string());
  });
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    try {
      FolderLock lock(dir.path.string());
    } catch (const UsageError&) {
      ++refused;
    }
  }
  done = true;
  checker.join();
  EXPECT_EQ(refused, 0);
}

// The same from the command line: a second `scaletrain train` in the folder of one that is
// running exits 2 before it starts any worker.
TEST(FolderOwner, SecondCommandLineRunExitsTwo) {
  TempDir dir("owner_cli");
  const std::string out = dir.path.string();
  const std::string train = cli_path() +
                            " train --device cpu --dataset synthetic --limit-train 16384 "
                            "--limit-test 64 --batch-size 16 --epochs 1 --no-progress --out " +
                            out;
  // The first run's rank 0 writes its name into the lock file once it holds the lock.
  auto r =
      run_command(train + " > " + out + "/first.log 2>&1 & first=$!; for i in $(seq 600); do " +
                      "[ -s " + out + "/.scaletrain.lock ] && break; sleep 0.05; done; " + train +
                      " --resume auto; status=$?; kill -INT $first; wait $first; exit $status",
                  180);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is in use by a live run (process "), std::string::npos) << r.output;
}

// ---- Errors instead of crashes and backtraces --------------------------------------------------

// Regression (DefaultDistSegfaults): train() and DDP with a default-constructed Dist crashed.
TEST(Misuse, AnUnjoinedDistIsRefused) {
  std::mutex mu;
  TempDir dir("unjoined");
  try {
    train(small_task(mu), options_for(Strategy::kDDP, dir.path.string()), Dist{});
    FAIL() << "train() took a Dist{}";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("init_process_group()"), std::string::npos) << e.what();
  }
  EXPECT_THROW(DistributedDataParallel(std::make_shared<NetImpl>(), Dist{}), UsageError);
}

// Regression (RanksOfDifferentWorldSizesHang): rank 1 started with another WORLD_SIZE than rank 0
// hung or failed with a raw network error; now both fail at once, naming the odd rank.
TEST(Misuse, RanksStartedWithDifferentWorldSizesAreNamed) {
  const int port = testing::free_port();
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        InitOptions o;
        World w;
        w.rank = r;
        w.world_size = r == 0 ? 2 : 3;
        w.master_port = port;
        o.world = w;
        o.backend = "gloo";
        o.rendezvous_timeout = std::chrono::seconds(60);
        init_process_group(o);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 1 was started with WORLD_SIZE 3 and rank 0 with 2"), std::string::npos)
        << e;
  }
  EXPECT_LT(seconds, 30) << "long before the 60 s rendezvous timeout";
}

// Regression (CastAfterWrappingFailsElsewhere): model->to(kDouble) after DDP was made failed in
// the next step with an unrelated message.
TEST(Misuse, AParameterCastAfterWrappingIsNamed) {
  auto errors = testing::run_ranks(1, [](Dist& d) {
    auto net = std::make_shared<NetImpl>();
    DistributedDataParallel ddp(net, d);
    net->to(at::kDouble);
    ddp(at::randn({2, 6}, at::kDouble));
  });
  EXPECT_NE(errors[0].find("parameter 'a.weight' is now Double on cpu, and DDP was made for it as "
                           "Float on cpu"),
            std::string::npos)
      << errors[0];
}

// Regression (ModelAgainstDataBacktrace): a model built for other inputs failed inside the first
// step in LibTorch's words; now before any work, with the shapes.
TEST(Misuse, AModelThatCannotTakeTheDataIsRefusedFirst) {
  std::mutex mu;
  TempDir dir("shapes");
  TrainTask task = small_task(mu);
  task.model = [] {
    auto net = std::make_shared<torch::nn::LinearImpl>(5, 3);  // the data has 6 features
    return model_of(net, "linear");
  };
  auto errors = testing::run_ranks(
      1, [&](Dist& d) { train(task, options_for(Strategy::kDDP, dir.path.string()), d); });
  EXPECT_NE(errors[0].find("the model 'linear' cannot take the data's samples (a batch of one is "
                           "[1, 6], Float)"),
            std::string::npos)
      << errors[0];
}

// Regression (LeNetOnAnotherImageSize): the zoo says which flag to change.
TEST(Misuse, LeNetOnAnotherImageSizeNamesTheFlag) {
  TempDir dir("lenet_size");
  fs::create_directories(dir.path / "train" / "a");
  fs::create_directories(dir.path / "val" / "a");
  auto r = run_command(cli_path() + " train --nproc-per-node 1 --no-progress --model lenet " +
                       "--dataset folder --image-size 32 --data-dir " + dir.path.string() +
                       " --out " + (dir.path / "out").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--model lenet takes 28x28 images"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}

// Regression (SequencePositionsTakenForClasses): with a sequence model whose length equals its
// vocabulary, the default loss and accuracy took the positions for the classes. Classes are the
// last dimension; other shapes are refused.
TEST(Misuse, SequenceOutputsTakeTheirClassesFromTheLastDimension) {
  const auto out = at::randn({2, 5, 5});
  auto y = at::randint(5, {2, 5}, at::kLong);
  y[0][0] = out[0][0].argmax().item<int64_t>();
  const auto right = (out.argmax(-1) == y).to(at::kDouble).mean(1);
  EXPECT_TRUE(at::allclose(accuracy().per_sample(out, y), right));
  EXPECT_THROW(accuracy().per_sample(at::randn({2, 5}), at::randint(5, {2, 5}, at::kLong)),
               UsageError);
  EXPECT_THROW(check_class_shapes(at::randn({2, 4, 5}), at::randint(5, {2, 5}, at::kLong), "x"),
               UsageError);
  // Through the trainer: the first step's loss is cross entropy over the last dimension.
  struct SeqImpl : torch::nn::Module {
    torch::nn::Linear proj{register_module("proj", torch::nn::Linear(5, 5))};
    at::Tensor forward(const at::Tensor& x) { return proj(x); }  // [B, 5 positions, 5 classes]
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Dataset data;
  data.inputs = at::randn({8, 5, 5}, gen);
  data.targets = at::randint(5, {8, 5}, gen, at::kLong);
  auto seq = std::make_shared<SeqImpl>();
  const double expected =
      torch::nn::functional::cross_entropy(seq->forward(data.inputs).reshape({-1, 5}),
                                           data.targets.reshape({-1}))
          .item<double>();
  TempDir dir("sequence");
  double first = 0;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    TrainTask task;
    task.train_data = in_memory(data);
    task.model = [&] { return model_of(seq, "seq"); };
    task.on_step = [&](const StepReport& r) { first = r.loss; };
    TrainerOptions o = options_for(Strategy::kDDP, dir.path.string());
    o.batch_size = 8;
    train(task, o, d);
  });
  ASSERT_EQ(errors[0], "");
  EXPECT_NEAR(first, expected, 1e-5 * std::abs(expected));
}

// Regression (FsdpWithoutBlocksWasCalledAPipelineStrategy): fsdp on a model without a chain of
// blocks said "the pipeline strategies split the model" and offered ddp or dp only. It names
// fsdp, what it needs the chain for, and the sharded strategies that need none.
TEST(Misuse, FsdpWithoutBlocksWasCalledAPipelineStrategy) {
  std::mutex mu;
  TempDir dir("fsdp_blocks");
  TrainTask task = small_task(mu);
  task.model = [] { return model_of(std::make_shared<NetImpl>(), "net"); };  // no blocks
  auto errors = testing::run_ranks(
      1, [&](Dist& d) { train(task, options_for(Strategy::kFsdp, dir.path.string()), d); });
  EXPECT_NE(errors[0].find("TrainerOptions::strategy fsdp shards the model in units, one per "
                           "block of its chain"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("model 'net' has none: give Model::blocks"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("or train with zero1 or zero2"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[0].find("pipeline"), std::string::npos) << errors[0];
}

// ---- Checkpoint files --------------------------------------------------------------------------

// Regression (SaveOnEveryRankCollides): save_checkpoint() called on every rank died with "cannot
// rename ...tmp"; each writer now has its own temporary, and the last rename wins whole.
TEST(CheckpointFiles, SavedByManyWritersAtOnceStaysWholeAndLeavesNoTemporary) {
  TempDir dir("writers");
  std::vector<std::thread> writers;
  std::vector<std::string> errors(4);
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      try {
        auto net = std::make_shared<NetImpl>();
        TrainingState s;
        s.run_id = "run";
        s.model_name = "net";
        s.global_step = 7;
        save_checkpoint(dir.path.string(), s, *net, nullptr, 3);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(w)] = e.what();
      }
    });
  }
  for (auto& t : writers) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_FALSE(checkpoint_problem((dir.path / "ckpt-7.st").string()).has_value());
  for (auto& e : fs::directory_iterator(dir.path)) EXPECT_NE(e.path().extension(), ".tmp");
}

// Regression (FailedWritesLeaveTemporaries): a failed model.pt or checkpoint write left its
// temporary file behind.
TEST(CheckpointFiles, AFailedWriteLeavesNothingBehind) {
  TempDir dir("failed");
  fs::create_directories(dir.path / "model.pt" / "inside");  // rename onto it fails
  auto net = std::make_shared<NetImpl>();
  EXPECT_THROW(save_weights((dir.path / "model.pt").string(), *net), Error);
  TrainingState s;
  s.run_id = "run";
  s.model_name = "net";
  s.global_step = 3;
  fs::create_directories(dir.path / "ckpt-3.st" / "inside");
  EXPECT_THROW(save_checkpoint(dir.path.string(), s, *net, nullptr, 1), Error);
  std::vector<std::string> left;
  for (auto& e : fs::directory_iterator(dir.path)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt-3.st", "model.pt"}));
}

// Regression (HeaderSizeTooSmallCalledTruncated): a header that undercounts its payload was
// reported as "truncated (1048909 of 1048900 bytes)".
TEST(CheckpointFiles, AHeaderThatUndercountsIsADamagedHeaderNotATruncation) {
  TempDir dir("header");
  auto net = std::make_shared<NetImpl>();
  TrainingState s;
  s.run_id = "run";
  s.model_name = "net";
  const auto path = save_checkpoint(dir.path.string(), s, *net, nullptr, 1);
  std::ofstream(path, std::ios::app) << "trailing bytes";
  const auto problem = checkpoint_problem(path);
  ASSERT_TRUE(problem.has_value());
  EXPECT_NE(problem->find("damaged header"), std::string::npos) << *problem;
  EXPECT_EQ(problem->find("truncated"), std::string::npos) << *problem;
}

// Regression (SkippingPrintedFiveTimes, DamagedShardSkippedSilently): a damaged checkpoint is
// reported once per process, and a damaged shard of a sharded checkpoint names the rank's file.
TEST(CheckpointFiles, DamagedFilesAreReportedOnceAndShardsByTheirRank) {
  TempDir dir("skipped");
  auto net = std::make_shared<NetImpl>();
  TrainingState s;
  s.run_id = "run";
  s.model_name = "net";
  for (int64_t step : {1, 2}) {
    s.global_step = step;
    save_checkpoint(dir.path.string(), s, *net, nullptr, 5);
  }
  fs::resize_file(dir.path / "ckpt-2.st", fs::file_size(dir.path / "ckpt-2.st") - 3);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 5; ++i) newest_valid_checkpoint(dir.path.string());
  std::string said = ::testing::internal::GetCapturedStderr();
  size_t count = 0;
  for (size_t at = said.find("skipping"); at != std::string::npos;
       at = said.find("skipping", at + 1))
    ++count;
  EXPECT_EQ(count, 1u) << said;

  TempDir sharded("skipped_shards");
  for (int r = 0; r < 2; ++r) {
    s.global_step = 4;
    save_checkpoint((sharded.path / "world-2" / ("rank-" + std::to_string(r))).string(), s, *net,
                    nullptr, 5);
  }
  const auto shard1 = sharded.path / "world-2" / "rank-1" / "ckpt-4.st";
  fs::resize_file(shard1, fs::file_size(shard1) - 3);
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(newest_sharded_checkpoint(sharded.path.string()).has_value());
  said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("rank 1's file " + shard1.string() + " is truncated"), std::string::npos)
      << said;
}

// ---- Resumes that used to continue silently ----------------------------------------------------

// Regression (ChangedOptionsResumeSilently): --resume auto with another --lr or --seed went on
// without a word. Each difference is named with what wins.
TEST(Resume, ChangedOptionsAreNamedWithWhatWins) {
  TempDir dir("changed");
  const std::string base = cli_path() +
                           " train --nproc-per-node 1 --device cpu --dataset synthetic "
                           "--limit-train 128 --limit-test 32 --batch-size 32 --no-progress "
                           "--out " +
                           dir.path.string();
  auto a = run_command(base + " --epochs 1");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_command(base + " --epochs 2 --lr 0.01 --seed 5");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("resume: seed 5 is not the checkpoint's 0: the checkpoint's goes on"),
            std::string::npos)
      << b.output;
  EXPECT_NE(b.output.find("resume: learning rate 0.01 differs from the checkpoint's: 0.01 goes on"),
            std::string::npos)
      << b.output;
}

// ---- Each rank its own random stream -----------------------------------------------------------

// Regression (EveryRankDrawsTheSameDropout): every rank was seeded alike, so under DDP all ranks
// drew the same dropout masks. Each rank's stream is its own, and the checkpoint holds them all.
TEST(RankStreams, EachRankDrawsItsOwnStreamAndTheCheckpointHoldsThemAll) {
  EXPECT_EQ(rank_seed(42, 0), 42u);
  std::set<uint64_t> seeds;
  for (int r = 0; r < 64; ++r) seeds.insert(rank_seed(42, r));
  EXPECT_EQ(seeds.size(), 64u);
  TempDir dir("streams");
  auto r = run_command(cli_path() +
                       " train --nproc-per-node 2 --device cpu --dataset synthetic --model mlp "
                       "--dropout 0.5 --limit-train 128 --limit-test 32 --batch-size 32 "
                       "--epochs 1 --no-progress --out " +
                       dir.path.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Model m = make_model("mlp");
  auto state = load_checkpoint((dir.path / "ckpt-4").string(), *m.module, nullptr, "mlp");
  ASSERT_TRUE(state.tensors.count("rng/rank0/cpu") && state.tensors.count("rng/rank1/cpu"));
  EXPECT_EQ(state.tensors.at("rng/world").item<int64_t>(), 2);
  EXPECT_FALSE(at::equal(state.tensors.at("rng/rank0/cpu"), state.tensors.at("rng/rank1/cpu")));
}

}  // namespace
}  // namespace scaletrain
