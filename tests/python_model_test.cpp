// Models defined in Python, trained by scaletrain (python_model.h), against PyTorch itself (the
// project's .venv, tests/scripts/python_models.py): a scripted nn.Sequential CNN and a scripted
// decoder of its own class, trained here under several strategies on recorded batches, and in
// eager Python on the same batches from the same weights. The step losses and the final weights
// agree to rounding, and Python loads the trained model.pt into its module by name.

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>

#include "scaletrain/amp.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/python_model.h"
#include "scaletrain/trainer.h"
#include "support/python.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::string python(const std::string& args) {
  return testing::run_python("python_models.py", args);
}

// The modules and data Python wrote (made once per build, support/python.h).
const fs::path& made() {
  static const fs::path dir = testing::made_by("python_models.py");
  return dir;
}

std::map<std::string, at::Tensor> read_dict(const fs::path& p);
std::map<std::string, at::Tensor> data() { return read_dict(made() / "data.pt"); }

struct Setup {
  std::string kind;  // cnn or lm
  Strategy strategy;
  int ranks = 2;
  std::vector<at::Device> devices;  // dp, pipeline
};

struct Trained {
  std::vector<double> losses;                         // rank 0's, per step
  std::vector<std::vector<std::vector<int64_t>>> by;  // per rank: each step's indices
};

// One epoch of 64 samples in global batches of 16 (4 steps), each rank's batches recorded.
Trained train_here(const Setup& s, const fs::path& out,
                   const std::function<void(TrainTask&, TrainerOptions&)>& tweak = {}) {
  const auto d = data();
  Dataset set{s.kind == "cnn" ? d.at("images") : d.at("tokens"),
              s.kind == "cnn" ? d.at("classes") : d.at("next"), s.kind == "cnn" ? 10 : 0};
  Trained t;
  t.by.resize(static_cast<size_t>(s.ranks));
  std::vector<bool> sampled(static_cast<size_t>(s.ranks), false);
  std::mutex m;
  auto errors = testing::run_ranks(
      s.ranks,
      [&](Dist& dist) {
        TrainTask task;
        task.model = [&] { return load_python_model((made() / (s.kind + ".pt")).string()); };
        task.train_data = in_memory(set);
        task.train_data.rows.reset();  // every batch through `batch`, recorded
        auto inner = task.train_data.batch;
        task.train_data.batch = [&, inner, r = dist.rank()](const std::vector<int64_t>& idx,
                                                            uint64_t seed) {
          std::lock_guard<std::mutex> lock(m);
          // The first call is the trainer's check of the model with a few samples (rows 0-7),
          // not a step's batch.
          auto& mine = t.by[static_cast<size_t>(r)];
          if (!sampled[static_cast<size_t>(r)]) {
            sampled[static_cast<size_t>(r)] = true;
          } else {
            mine.push_back(idx);
          }
          return inner(idx, seed);
        };
        task.test_data = in_memory(set, 16);
        task.metrics = {};
        task.on_step = [&, r = dist.rank()](const StepReport& report) {
          if (r == 0) t.losses.push_back(report.loss);
        };
        TrainerOptions o;
        o.strategy = s.strategy;
        o.devices = s.devices;
        o.epochs = 1;
        o.batch_size = 16;
        o.device = at::kCPU;
        o.progress = false;
        o.tensorboard = false;
        o.resume = Resume::none();
        o.out_dir = out.string();
        if (tweak) tweak(task, o);
        train(task, o, dist);
      },
      std::chrono::seconds(120));
  if (!tweak) {
    EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(s.ranks)));
  }
  return t;
}

std::map<std::string, at::Tensor> read_dict(const fs::path& p) {
  return testing::read_tensor_dict(p.string());
}

// Trains `s` here and in eager Python on the same batches; returns Python's verdict.
void expect_as_python(const Setup& s, double terms, const std::string& name) {
  testing::TempDir dir("python_model_" + name);
  const Trained t = train_here(s, dir.path);
  nlohmann::json order = nlohmann::json::array();  // each step's global batch: every rank's
  for (size_t step = 0; step < t.by[0].size(); ++step) {
    std::vector<int64_t> batch;
    for (const auto& rank : t.by) batch.insert(batch.end(), rank[step].begin(), rank[step].end());
    order.push_back(batch);
  }
  std::ofstream(dir.path / "order.json") << order.dump();
  const std::string said =
      python("eager " + made().string() + " " + s.kind + " " + dir.path.string());
  const auto verdict = nlohmann::json::parse(said.substr(said.rfind('{')));
  const auto losses = verdict.at("losses").get<std::vector<double>>();
  ASSERT_EQ(t.losses.size(), 4u) << name;
  ASSERT_EQ(losses.size(), 4u) << said;
  // Note [Tolerances]: fp32 sums of at most `terms` products, in another order on each side (the
  // ranks' halves, the micro-batches), agree to terms · 2^-24 relative; each step's weights
  // carry the last step's difference into the next losses: one more such bound per step.
  const double u = std::ldexp(1.0, -24);
  for (size_t k = 0; k < losses.size(); ++k) {
    EXPECT_NEAR(t.losses[k], losses[k], 4 * static_cast<double>(k + 1) * terms * u * losses[k])
        << name << " step " << k + 1;
  }
  EXPECT_LE(verdict.at("max_diff").get<double>(),
            4 * 5 * terms * u * verdict.at("max_weight").get<double>())
      << name << ": model.pt, loaded into the Python module by name, against eager training";
}

// The CNN's longest sum: its Linear's 676 inputs.
TEST(PythonModel, ScriptedCnnTrainsAsEagerPythonUnderDdpFsdpPipelineDpAndZero1) {
  expect_as_python({"cnn", Strategy::kDDP, 2, {}}, 676, "cnn_ddp");
  expect_as_python({"cnn", Strategy::kFsdp, 2, {}}, 676, "cnn_fsdp");
  expect_as_python({"cnn", Strategy::kPipeline, 1, {at::kCPU, at::kCPU}}, 676, "cnn_pipeline");
  expect_as_python({"cnn", Strategy::kDataParallel, 1, {at::kCPU, at::kCPU}}, 676, "cnn_dp");
  expect_as_python({"cnn", Strategy::kZero1, 2, {}}, 676, "cnn_zero1");
}

// A module of its own class (one block for fsdp's units); its longest sum: the loss's mean over
// the batch's 16 · 8 positions (its matmuls sum 16 to 32 products).
TEST(PythonModel, ScriptedDecoderTrainsAsEagerPythonUnderZero2AndFsdp) {
  expect_as_python({"lm", Strategy::kZero2, 2, {}}, 128, "lm_zero2");
  expect_as_python({"lm", Strategy::kFsdp, 2, {}}, 128, "lm_fsdp");
}

// The crossing a user hits: a Python model's fsdp run on 2 ranks stopped mid-epoch (after step
// 2 of 4, its checkpoint of step 2 kept) and resumed under ddp on one rank ends on the weights of
// the uninterrupted run, to the rounding of sums over one rank's batch against two halves.
TEST(PythonModel, ResumesMidEpochUnderAnotherStrategyAndWorldSize) {
  testing::TempDir straight("python_model_straight"), resumed("python_model_resumed");
  train_here({"cnn", Strategy::kFsdp, 2, {}}, straight.path);
  train_here({"cnn", Strategy::kFsdp, 2, {}}, resumed.path, [](TrainTask& task, TrainerOptions& o) {
    o.checkpoint_every = 1;
    task.on_step = [](const StepReport& r) {
      if (r.global_step == 2) throw std::runtime_error("stopped at step 2");
    };
  });
  ASSERT_FALSE(fs::exists(resumed.path / "model.pt")) << "the first run stopped before its end";
  const Trained rest =
      train_here({"cnn", Strategy::kDDP, 1, {}}, resumed.path,
                 [](TrainTask&, TrainerOptions& o) { o.resume = Resume::automatic(); });
  EXPECT_EQ(rest.losses.size(), 2u) << "steps 3 and 4 only";
  const auto a = read_dict(straight.path / "model.pt"), b = read_dict(resumed.path / "model.pt");
  ASSERT_EQ(a.size(), 4u);
  double top = 0;
  for (const auto& [name, w] : a) top = std::max(top, w.abs().max().item<double>());
  for (const auto& [name, w] : a) {  // Note [Tolerances]: the Linear's 676-term sums, 4 steps
    EXPECT_LE((w - b.at(name)).abs().max().item<double>(), 4 * 4 * 676 * std::ldexp(1.0, -24) * top)
        << name;
  }
}

TEST(PythonModel, KeepsPythonsNamesAndSharesItsTensors) {
  Model m = load_python_model((made() / "cnn.pt").string());
  std::vector<std::string> names;
  for (const auto& p : m.module->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "4.weight", "4.bias"}));
  EXPECT_EQ(as_sequential(m)->size(), 5u) << "an nn.Sequential's blocks are its children";
  const auto x = at::randn({2, 1, 28, 28});
  const auto before = m.forward(x);
  {
    torch::NoGradGuard no_grad;
    m.module->named_parameters()["4.bias"].add_(1.0);
  }
  EXPECT_TRUE(at::allclose(m.forward(x), before + 1.0)) << "the script reads the same tensors";
  {  // --amp bf16: the script's ops take the autocast scope as a C++ module's do
    Autocast bf16(at::kCPU, at::kBFloat16);
    EXPECT_EQ(m.forward(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(m.forward(x).scalar_type(), at::kFloat);
  Model lm = load_python_model((made() / "lm.pt").string());
  EXPECT_EQ(as_sequential(lm)->size(), 1u) << "a module of its own class is one block";
  EXPECT_TRUE(lm.module->named_parameters().contains("mlp.2.weight"));
  EXPECT_TRUE(lm.module->named_parameters().contains("pos"));
}

TEST(PythonModel, RefusesWhatItCannotTrainByName) {
  const auto refused = [](const std::string& path) {
    try {
      load_python_model(path);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_NE(refused((made() / "bad_arity.pt").string()).find("forward takes 2 inputs"),
            std::string::npos);
  EXPECT_NE(refused((made() / "frozen.pt").string()).find("no trainable parameter"),
            std::string::npos);
  EXPECT_NE(refused((made() / "data.pt").string()).find("not a TorchScript module"),
            std::string::npos)
      << "torch.save's zip, not a module";
  EXPECT_NE(refused((made() / "none.pt").string()).find("no such file"), std::string::npos);
  testing::TempDir own("python_model_refusals");  // the shared folder stays as Python made it
  const fs::path text = own.path / "notes.pt";
  std::ofstream(text) << "not a zip";
  EXPECT_NE(refused(text.string()).find("not a TorchScript archive"), std::string::npos);
}

// The command line's --model FILE.pt: two processes on synthetic images, and Python loads the
// run's model.pt into its module by name.
TEST(PythonModel, CommandLineTrainsAFileAndPythonLoadsTheResult) {
  testing::TempDir dir("python_model_cli");
  const std::string model = (made() / "cnn.pt").string();
  auto r =
      testing::run_command(testing::cli_path() + " train --model " + model +
                               " --dataset synthetic --limit-train 64 --limit-test 32 "
                               "--epochs 1 --batch-size 16 --nproc-per-node 2 --device cpu --out " +
                               (dir.path / "out").string() + " 2>&1",
                           300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ofstream(dir.path / "out" / "order.json") << "[]";  // no steps: the load alone
  const std::string said =
      python("eager " + made().string() + " cnn " + (dir.path / "out").string());
  EXPECT_NE(said.find("\"max_diff\""), std::string::npos) << said;
  auto bad = testing::run_command(testing::cli_path() + " train --model " +
                                      (made() / "frozen.pt").string() +
                                      " --dataset synthetic --epochs 1 --device cpu --out " +
                                      (dir.path / "bad").string() + " 2>&1",
                                  120);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("no trainable parameter"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace scaletrain
