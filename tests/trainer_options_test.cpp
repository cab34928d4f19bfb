// The trainer's options by concept (trainer_options.h): each strategy's own options in a group
// of their own, typed values read from the command line's text and written back, and errors
// that name the option as a program sets it.

#include "scaletrain/trainer_options.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/error.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

// The UsageError `f` throws; fails the test when it throws nothing.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "nothing was refused";
  return {};
}

TEST(TrainerOptions, TextValuesReadBackAsTheyWereWritten) {
  for (const std::string s : {"gpipe", "1f1b", "interleaved", "zb-h1"}) {
    EXPECT_EQ(to_string(parse_schedule(s)), s);
  }
  EXPECT_EQ(parse_schedule("zb-h1"), PipelineSchedule::kZeroBubbleH1);
  for (const std::string c : {"never", "except-last", "always"}) {
    EXPECT_EQ(to_string(parse_pipeline_checkpoint(c)), c);
  }
  EXPECT_EQ(parse_pipeline_checkpoint("except-last"), PipelineCheckpoint::kExceptLast);
  for (const std::string s : {"ddp", "dp", "pipeline", "grid", "zero1", "zero2", "fsdp"}) {
    EXPECT_EQ(to_string(parse_strategy(s)), s);
  }

  EXPECT_EQ(Balance::parse("auto").by, Balance::By::kTime) << "auto is time, the default";
  EXPECT_EQ(Balance::parse("time").str(), "time");
  EXPECT_EQ(Balance::parse("size").by, Balance::By::kSize);
  const auto listed = Balance::parse("2,3,1");
  EXPECT_EQ(listed.by, Balance::By::kLayers);
  EXPECT_EQ(listed.layers, (std::vector<int>{2, 3, 1}));
  EXPECT_EQ(listed.str(), "2,3,1");
  EXPECT_EQ(Balance::of({4, 4}).str(), "4,4");

  EXPECT_EQ(Resume::parse("auto").kind, Resume::Kind::kAuto);
  EXPECT_EQ(Resume::parse("none").kind, Resume::Kind::kNone);
  const auto file = Resume::parse("runs/a/ckpt-4.st");
  EXPECT_EQ(file.kind, Resume::Kind::kFile);
  EXPECT_EQ(file.file, "runs/a/ckpt-4.st");
  EXPECT_EQ(file.str(), "runs/a/ckpt-4.st");
  EXPECT_EQ(TrainerOptions{}.resume.kind, Resume::Kind::kAuto) << "the default resumes";

  EXPECT_EQ(parse_device("cuda:1"), c10::Device(c10::kCUDA, 1));
  EXPECT_FALSE(parse_device("cuda").has_index()) << "cuda: the rank's own GPU";
  EXPECT_TRUE(parse_device("cpu").is_cpu());
  EXPECT_FALSE(TrainerOptions{}.device.has_value()) << "unset: a GPU when there is one";
}

TEST(TrainerOptions, BadTextIsRefusedNamingTheOptionAndTheChoices) {
  EXPECT_NE(refusal([] {
              Balance::parse("2,x");
            }).find("TrainerOptions::pipeline.balance '2,x': 'x' is not a positive number"),
            std::string::npos);
  EXPECT_NE(refusal([] { Balance::parse("2,0"); }).find("'0' is not a positive number"),
            std::string::npos);
  EXPECT_NE(refusal([] {
              parse_schedule("zb");
            }).find("unknown TrainerOptions::pipeline.schedule 'zb'; use gpipe, 1f1b"),
            std::string::npos);
  EXPECT_NE(refusal([] {
              parse_pipeline_checkpoint("sometimes");
            }).find("unknown TrainerOptions::pipeline.checkpoint 'sometimes'"),
            std::string::npos);
  EXPECT_NE(refusal([] {
              parse_device("tpu", "TrainerOptions::device");
            }).find("unknown TrainerOptions::device 'tpu'; give cpu, cuda or cuda:N"),
            std::string::npos);
  EXPECT_NE(refusal([] { parse_device("mps"); }).find("unknown device 'mps'"), std::string::npos)
      << "a device LibTorch knows, which the trainer does not run on";
  EXPECT_NE(refusal([] { Resume::parse(""); }).find("TrainerOptions::resume is empty"),
            std::string::npos);
}

// Each strategy's own options are refused under another strategy, by the option's name; values a
// program can set but the command line cannot write are checked alike.
TEST(TrainerOptions, AStrategysOwnOptionsAreCheckedByTheirNames) {
  testing::TempDir dir("trainer_options");
  auto fresh = [&] {
    TrainerOptions o;
    o.out_dir = dir.path.string();
    return o;
  };
  auto o = fresh();
  o.pipeline.chunks = 4;
  EXPECT_NE(refusal([&] { validate(o, 1); })
                .find("TrainerOptions::pipeline.chunks is for the pipeline strategies "
                      "(pipeline, grid), not TrainerOptions::strategy ddp"),
            std::string::npos);
  // Regression (PipelineOptionAtItsDefaultPassedUnseen): whether a field was given was guessed
  // by comparing it with its default, so a schedule of gpipe, a balance of time or 2 grid stages
  // given to ddp passed silently. Each field given is named, whatever its value.
  o = fresh();
  o.pipeline.schedule = PipelineSchedule::kGPipe;
  o.pipeline.balance = Balance::time();
  EXPECT_NE(refusal([&] { validate(o, 1); })
                .find("TrainerOptions::pipeline.schedule and TrainerOptions::pipeline.balance "
                      "are for the pipeline strategies (pipeline, grid), not "
                      "TrainerOptions::strategy ddp"),
            std::string::npos);
  // pipeline.stages is the grid's alone: given elsewhere it is named, at its default (2) too.
  for (const auto& [strategy, stages] : std::vector<std::pair<Strategy, int>>{
           {Strategy::kDDP, 2}, {Strategy::kPipeline, 2}, {Strategy::kDDP, 4}}) {
    o = fresh();
    o.strategy = strategy;
    o.pipeline.stages = stages;
    EXPECT_NE(refusal([&] {
                validate(o, 1);
              }).find("TrainerOptions::pipeline.stages is for TrainerOptions::strategy grid"),
              std::string::npos)
        << to_string(strategy) << " " << stages;
  }
  o = fresh();
  o.pipeline.balance = Balance::size();
  o.strategy = Strategy::kZero2;
  EXPECT_NE(refusal([&] { validate(o, 1); }).find("not TrainerOptions::strategy zero2"),
            std::string::npos);

  o = fresh();
  o.strategy = Strategy::kPipeline;
  o.pipeline.balance = Balance::of({2, 0});
  EXPECT_NE(refusal([&] {
              validate(o, 1);
            }).find("TrainerOptions::pipeline.balance '2,0' has a stage of 0 blocks"),
            std::string::npos);
  o.pipeline.balance = Balance::of({1, 1, 1});
  EXPECT_NE(refusal([&] { validate(o, 1); })
                .find("TrainerOptions::pipeline.balance '1,1,1' gives 3 stages; the pipeline "
                      "has 2"),
            std::string::npos);
  o.pipeline.balance = Balance::of({1, 1});
  EXPECT_NO_THROW(validate(o, 1));

  o = fresh();
  o.strategy = Strategy::kZero1;
  o.ddp.uneven_inputs = UnevenInputs::kJoin;
  EXPECT_NE(refusal([&] {
              validate(o, 2);
            }).find("TrainerOptions::ddp.uneven_inputs is for TrainerOptions::strategy ddp"),
            std::string::npos);
  o.strategy = Strategy::kDDP;
  o.tensor_parallel.size = 2;
  EXPECT_NE(refusal([&] { validate(o, 2); })
                .find("TrainerOptions::ddp.uneven_inputs join with "
                      "TrainerOptions::tensor_parallel.size is not supported yet"),
            std::string::npos);

  o = fresh();
  o.device = c10::Device(c10::kMPS);
  EXPECT_NE(refusal([&] {
              validate(o, 1);
            }).find("TrainerOptions::device mps is neither the CPU nor a CUDA device"),
            std::string::npos);
  o = fresh();
  o.strategy = Strategy::kDataParallel;
  o.devices = {c10::Device(c10::kCPU), c10::Device(c10::kMPS)};
  EXPECT_NE(refusal([&] {
              validate(o, 1);
            }).find("TrainerOptions::devices lists mps, which is neither the CPU nor a CUDA"),
            std::string::npos);

  o = fresh();
  o.resume = Resume::from((dir.path / "ckpt-9.st").string());
  EXPECT_NE(refusal([&] { validate(o, 1); }).find("ckpt-9.st': no such checkpoint"),
            std::string::npos);
}

// The strategy words are shorthand for parallel degrees (parallel_dims.h): each word, with and
// without a tensor-parallel degree, against the degrees written by hand, at a world.
TEST(TrainerOptions, StrategyWordsStandForParallelDims) {
  struct Row {
    const char* strategy;
    int tp, stages, world;
    ParallelDims dims;  // resolved at `world`
  };
  using d = ParallelDims;  // {dp_replicate, dp_shard, zero_stage, pp, tp}
  const std::vector<Row> table{
      {"ddp", 1, 2, 4, d{4, 1, 0, 1, 1}},   {"ddp", 2, 2, 8, d{4, 1, 0, 1, 2}},
      {"zero1", 1, 2, 4, d{1, 4, 1, 1, 1}}, {"zero2", 2, 2, 4, d{1, 2, 2, 1, 2}},
      {"fsdp", 2, 2, 8, d{1, 4, 3, 1, 2}},  {"grid", 1, 2, 4, d{2, 1, 0, 2, 1}},
      {"grid", 2, 2, 8, d{2, 1, 0, 2, 2}},  {"grid", 1, 3, 3, d{1, 1, 0, 3, 1}},
      {"dp", 1, 2, 1, d{1, 1, 0, 1, 1}},    {"pipeline", 1, 2, 1, d{1, 1, 0, 1, 1}},
  };
  for (const auto& row : table) {
    TrainerOptions o;
    o.strategy = parse_strategy(row.strategy);
    o.tensor_parallel.size = row.tp;
    o.pipeline.stages = row.stages;
    const auto resolved = parallel_dims(o).resolve(row.world);
    EXPECT_EQ(resolved, row.dims) << row.strategy << " tp " << row.tp << " at " << row.world << ": "
                                  << resolved.describe();
  }
  // Expert parallelism borrows its ranks from dp: ddp at 4 with ep 2 is dp 4 (ep 2).
  TrainerOptions o;
  o.expert_parallel.size = 2;
  EXPECT_EQ(parallel_dims(o).resolve(4), (d{4, 1, 0, 1, 1, 1, 2}));
  EXPECT_EQ(parallel_dims(o).resolve(4).describe(), "dp 4 (ep 2)");
}

}  // namespace
}  // namespace scaletrain

namespace scaletrain {
namespace {

// Unset fields read as their documented defaults; given ones as given, and given() names them.
TEST(PipelineTrainOptions, ResolvedFillsTheDefaultsAndGivenNamesWhatWasSet) {
  PipelineTrainOptions p;
  auto r = p.resolved();
  EXPECT_EQ(r.schedule, PipelineSchedule::kGPipe);
  EXPECT_EQ(r.chunks, 0);
  EXPECT_EQ(r.split_size, 0);
  EXPECT_EQ(r.balance.by, Balance::By::kTime);
  EXPECT_EQ(r.checkpoint, PipelineCheckpoint::kNever);
  EXPECT_EQ(r.stages, 2);
  EXPECT_EQ(r.stages_per_device, 1);
  EXPECT_TRUE(p.given().empty());
  p.stages_per_device = 2;
  p.chunks = 0;
  p.stages = 4;
  r = p.resolved();
  EXPECT_EQ(r.stages, 4);
  EXPECT_EQ(r.stages_per_device, 2);
  EXPECT_EQ(p.given(), (std::vector<std::string>{"TrainerOptions::pipeline.chunks",
                                                 "TrainerOptions::pipeline.stages",
                                                 "TrainerOptions::pipeline.stages_per_device"}));
  EXPECT_EQ(p.given({"stages"}),
            (std::vector<std::string>{"TrainerOptions::pipeline.chunks",
                                      "TrainerOptions::pipeline.stages_per_device"}));
}

}  // namespace
}  // namespace scaletrain
