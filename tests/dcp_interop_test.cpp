// DCP folders both ways with PyTorch itself (the project's .venv, tests/scripts/dcp_interop.py):
// Python's dcp.load (into a plain model, and into DTensors over two processes) and
// dcp_to_torch_save read what scaletrain's ranks wrote; scaletrain reads what Python's dcp.save
// wrote over two processes, at other layouts; a model and its Adam go both ways through
// get_state_dict; a run starts from a Python DCP folder as from the same weights in model.pt.
// Every comparison is bit for bit: a checkpoint moves bytes, it computes nothing.

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>

#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/tokens.h"
#include "scaletrain_zoo.h"
#include "support/python.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::string interop(const std::string& args) { return testing::run_python("dcp_interop.py", args); }

std::map<std::string, at::Tensor> read_dict(const fs::path& p) {
  return testing::read_tensor_dict(p.string());
}

void write_dict(const fs::path& p, const std::map<std::string, at::Tensor>& tensors) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [k, v] : tensors) d.insert(k, v);
  const auto bytes = torch::pickle_save(d);
  std::ofstream(p, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Rank r's piece of n in `parts` as torch.chunk cuts it (the last ones shorter or empty).
Box piece(const std::vector<int64_t>& shape, size_t dim, int parts, int r) {
  const int64_t c = (shape[dim] + parts - 1) / parts;
  Box b = whole(shape);
  b.offsets[dim] = c * r;
  b.sizes[dim] = c;
  return clip(b, shape);
}

TensorBox box_of(const std::string& fqn, const at::Tensor& full, const Box& b) {
  at::Tensor t = full;
  for (size_t d = 0; d < b.offsets.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  return {dcp_model_key(fqn), t.clone(), full.sizes().vec(), b.offsets};
}

// Python's nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 4), nn.Linear(4, 6)), saved by 3 ranks:
// the first weight by rows (3, 3, 1), its bias replicated on every rank, the second weight by
// columns (3, 3, 1), its bias as ZeRO shards of a buffer padded to 6 (2, 2, and nothing on rank
// 2), the third weight and bias as ZeRO shards of one flat buffer of 30 (10 each: boxes of the
// weight's rows, part rows, then of the bias).
TEST(DcpInterop, PythonLoadsWhatThreeRanksSaved) {
  testing::TempDir tmp("dcp_py_load");
  const fs::path dir = tmp.path / "ckpt";
  torch::manual_seed(3);
  const std::map<std::string, at::Tensor> full = {
      {"0.weight", at::randn({7, 5})}, {"0.bias", at::randn({7})},
      {"1.weight", at::randn({4, 7})}, {"1.bias", at::randn({4})},
      {"2.weight", at::randn({6, 4})}, {"2.bias", at::randn({6})}};
  auto errors = testing::run_ranks(3, [&](Dist& d) {
    const int r = d.rank();
    DcpState s;
    s.tensors = {box_of("0.weight", full.at("0.weight"), piece({7, 5}, 0, 3, r)),
                 box_of("0.bias", full.at("0.bias"), whole({7})),
                 box_of("1.weight", full.at("1.weight"), piece({4, 7}, 1, 3, r)),
                 box_of("1.bias", full.at("1.bias"), clip(Box{{2 * r}, {2}}, {4}))};
    // One flat unit [2.weight (24), 2.bias (6)]: rank r holds its elements [10r, 10r + 10).
    auto in = [&](int64_t first, int64_t n, int64_t at) {
      return std::clamp(at - first, int64_t{0}, n);
    };
    for (const Box& b : flat_range_boxes({6, 4}, in(0, 24, 10 * r), in(0, 24, 10 * r + 10)))
      s.tensors.push_back(box_of("2.weight", full.at("2.weight"), b));
    for (const Box& b : flat_range_boxes({6}, in(24, 6, 10 * r), in(24, 6, 10 * r + 10)))
      s.tensors.push_back(box_of("2.bias", full.at("2.bias"), b));
    s.values = {{{"epoch", {}}, DcpValue::of(int64_t{3})},
                {{"name", {}}, DcpValue::of(std::string("lenet/run-1"))},
                {{"betas", {}}, DcpValue::tuple({DcpValue::of(0.9), DcpValue::of(0.999)})}};
    save_distributed_checkpoint(dir.string(), s, d);
  });
  ASSERT_EQ(errors, std::vector<std::string>(3, ""));
  const DcpContents c = read_distributed_checkpoint_contents(dir.string());
  EXPECT_EQ(c.tensors.at("model.0.weight").chunks.size(), 3u);
  EXPECT_EQ(c.tensors.at("model.0.bias").chunks.size(), 1u);
  EXPECT_EQ(c.tensors.at("model.1.bias").chunks.size(), 2u);
  // [0:2, 0:4] [2:3, 0:2] | [2:3, 2:4] [3:5, 0:4] | [5:6, 0:4]
  EXPECT_EQ(c.tensors.at("model.2.weight").chunks.size(), 5u);

  std::map<std::string, at::Tensor> ref;
  for (const auto& [k, v] : full) ref["model." + k] = v;
  write_dict(tmp.path / "ref.pt", ref);
  const std::string out = interop("check " + dir.string() + " " + (tmp.path / "ref.pt").string() +
                                  " " + (tmp.path / "whole.pt").string());
  EXPECT_NE(out.find("dcp.load and dcp_to_torch_save: 6 tensors and 3 values equal"),
            std::string::npos)
      << out;
  const std::string dt =
      interop("check-dtensor " + dir.string() + " " + (tmp.path / "ref.pt").string());
  EXPECT_NE(dt.find("dcp.load into DTensors over 2 processes: equal"), std::string::npos) << dt;
}

// DTensors of two gloo processes (rows 3 + 2, columns 3 + 2, bf16 rows 2 + 1, a replicated
// vector, a 0-d step), read here by 3 ranks' boxes along the other dimension, and whole.
TEST(DcpInterop, WeReadWhatPythonSavedOverTwoProcessesAtOtherLayouts) {
  testing::TempDir tmp("dcp_py_save");
  const fs::path dir = tmp.path / "ckpt";
  const std::string out = interop("save " + dir.string() + " " + (tmp.path / "ref.pt").string());
  ASSERT_NE(out.find("wrote .metadata, __0_0.distcp, __1_0.distcp"), std::string::npos) << out;
  const auto ref = read_dict(tmp.path / "ref.pt");
  const DcpContents c = read_distributed_checkpoint_contents(dir.string());
  ASSERT_EQ(c.tensors.size(), 5u);
  EXPECT_EQ(c.tensors.at("model.w").chunks,
            (std::vector<Box>{Box{{0, 0}, {3, 6}}, Box{{3, 0}, {2, 6}}}));
  EXPECT_EQ(c.tensors.at("model.v").chunks,
            (std::vector<Box>{Box{{0, 0}, {4, 3}}, Box{{0, 3}, {4, 2}}}));
  EXPECT_EQ(c.tensors.at("model.h").dtype, at::kBFloat16);
  for (int r = 0; r < 3; ++r) {
    std::vector<TensorBox> want;
    for (const auto& [name, t] : ref) {
      const Box b = t.dim() == 0 ? whole({}) : piece(t.sizes().vec(), t.dim() - 1, 3, r);
      want.push_back({{name, {}}, at::empty(b.sizes, t.options()), t.sizes().vec(), b.offsets});
    }
    load_distributed_checkpoint(dir.string(), want);
    for (const auto& b : want) {
      at::Tensor expect = ref.at(b.key.name);
      for (size_t d = 0; d < b.offsets.size(); ++d)
        expect = expect.narrow(static_cast<int64_t>(d), b.offsets[d], b.tensor.size(d));
      EXPECT_TRUE(at::equal(b.tensor, expect)) << b.key.name << " rank " << r;
    }
  }
  const auto all = load_distributed_checkpoint_tensors(dir.string());
  for (const auto& [name, t] : ref) EXPECT_TRUE(at::equal(all.at(name), t)) << name;
}

TEST(DcpInterop, ForeignClassInAPythonMetadataIsRefusedByName) {
  testing::TempDir tmp("dcp_py_foreign");
  const fs::path dir = tmp.path / "ckpt";
  DcpState s;
  s.tensors.push_back({dcp_model_key("w"), at::ones({2}), {2}, {}});
  save_distributed_checkpoint(dir.string(), s, Dist{});
  interop("foreign " + dir.string());
  try {
    read_distributed_checkpoint_contents(dir.string());
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cannot read DCP metadata '" + (dir / ".metadata").string() +
                     "': it names datetime.date, which a DCP metadata file never holds"),
              std::string::npos)
        << m;
  }
}

// Python's nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4)): the same names.
torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 4));
}

// A model and Adam after 3 steps here, saved by 2 ranks that both hold all of it: Python's
// get_state_dict / dcp.load / set_state_dict takes every tensor bit for bit, with the
// hyperparameters its Adam needs to step on.
TEST(DcpInterop, PythonResumesOurModelAndAdam) {
  testing::TempDir tmp("dcp_py_optim");
  const fs::path dir = tmp.path / "ckpt";
  torch::manual_seed(4);
  auto m = mlp();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    m->forward(at::randn({8, 5})).pow(2).mean().backward();
    opt.step();
  }
  const DcpState state = dcp_module_state(*m, &opt);
  auto errors =
      testing::run_ranks(2, [&](Dist& d) { save_distributed_checkpoint(dir.string(), state, d); });
  ASSERT_EQ(errors, std::vector<std::string>(2, ""));
  EXPECT_EQ(read_distributed_checkpoint_contents(dir.string()).values.size(), 12u);
  std::map<std::string, at::Tensor> ref;
  for (const auto& b : state.tensors) ref[b.key.name] = b.tensor;
  write_dict(tmp.path / "ref.pt", ref);
  const std::string out =
      interop("optim-load " + dir.string() + " " + (tmp.path / "ref.pt").string());
  EXPECT_NE(out.find("16 tensors equal, lr 0.01, step 3.0"), std::string::npos) << out;
}

// The other way: 3 Adam steps in Python, dcp.save of get_state_dict(), loaded here into the same
// model and a LibTorch Adam, whose state is then what Python's was.
TEST(DcpInterop, WeResumePythonsModelAndAdam) {
  testing::TempDir tmp("dcp_optim_py");
  const fs::path dir = tmp.path / "ckpt";
  interop("optim-save " + dir.string() + " " + (tmp.path / "ref.pt").string());
  const auto ref = read_dict(tmp.path / "ref.pt");
  auto m = mlp();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01));
  load_dcp_module_state(dir.string(), *m, &opt);
  const DcpState now = dcp_module_state(*m, &opt);
  ASSERT_EQ(now.tensors.size(), ref.size());
  for (const auto& b : now.tensors) {
    EXPECT_TRUE(at::equal(b.tensor, ref.at(b.key.name))) << b.key.name;
  }
  const auto& s = static_cast<const torch::optim::AdamParamState&>(
      *opt.state().at(m->parameters()[0].unsafeGetTensorImpl()));
  EXPECT_EQ(s.step(), 3);
}

// The step losses of a run's folder, from its metrics.jsonl.
std::vector<double> metric_losses(const fs::path& out) {
  std::ifstream f(out / "metrics.jsonl");
  std::vector<double> losses;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

// The losses of every step of a short run in this process.
std::vector<double> step_losses(const TrainOptions& o) {
  auto errors = testing::run_ranks(1, [&](Dist& d) { train(o, d); });
  EXPECT_EQ(errors, std::vector<std::string>{""});
  return metric_losses(o.out_dir);
}

// The same LeNet from Python as model.pt, dcp.save({"model": sd}) and dcp.save(sd): the same
// weights, bit for bit, and runs with the same loss at every step.
TEST(DcpInterop, InitWeightsFromAPythonDcpFolderStartsAsModelPt) {
  testing::TempDir tmp("dcp_init");
  const fs::path nested = tmp.path / "nested", plain = tmp.path / "plain",
                 pt = tmp.path / "model.pt";
  interop("lenet " + nested.string() + " " + plain.string() + " " + pt.string());
  Model a = make_model("lenet"), b = make_model("lenet"), c = make_model("lenet");
  load_weights(pt.string(), *a.module);
  load_weights(nested.string(), *b.module);
  load_weights(plain.string(), *c.module);
  const auto pa = a.module->named_parameters(), pb = b.module->named_parameters(),
             pc = c.module->named_parameters();
  for (const auto& p : pa) {
    EXPECT_TRUE(at::equal(p.value(), pb[p.key()])) << p.key();
    EXPECT_TRUE(at::equal(p.value(), pc[p.key()])) << p.key();
  }
  TrainOptions o;
  o.dataset = "synthetic";
  o.limit_train = 256;
  o.limit_test = 64;
  o.epochs = 1;
  o.batch_size = 64;
  o.log_every = 1;
  o.progress = false;
  o.tensorboard = false;
  o.resume = Resume::none();
  o.device = at::kCPU;
  std::vector<std::vector<double>> runs;
  for (const fs::path& from : {pt, nested, plain}) {
    o.init_weights = from.string();
    o.out_dir = (tmp.path / ("run-" + from.filename().string())).string();
    runs.push_back(step_losses(o));
  }
  ASSERT_EQ(runs[0].size(), 4u);
  EXPECT_EQ(runs[1], runs[0]);
  EXPECT_EQ(runs[2], runs[0]);
}

// A Python job's DCP folder (LeNet and Adam after 3 steps, dcp.save of get_state_dict()) resumes
// a run: its weights and Adam's moments go on from epoch 1, step 0. Against a start from the same
// weights alone (model.pt): the first step's loss is the same (the same weights on the same
// batch), the next ones differ (Adam's moments), and the run's last checkpoint counts Python's 3
// steps and its own 4.
TEST(DcpInterop, ResumeFromAPythonJobsFolderTakesItsWeightsAndAdam) {
  testing::TempDir tmp("dcp_resume_py");
  const fs::path folder = tmp.path / "python-ckpt", pt = tmp.path / "model.pt";
  interop("lenet-adam " + folder.string() + " " + pt.string());
  const std::string common = testing::cli_path() +
                             " train --nproc-per-node 1 --device cpu --dataset synthetic "
                             "--limit-train 256 --limit-test 64 --epochs 1 --batch-size 64 "
                             "--optimizer adam --lr 0.01 --log-every 1 --no-progress ";
  const auto weights = testing::run_command(common + "--resume none --init-weights " + pt.string() +
                                            " --out " + (tmp.path / "weights").string());
  ASSERT_EQ(weights.exit_code, 0) << weights.output;
  const auto resumed = testing::run_command(common + "--resume " + folder.string() + " --out " +
                                            (tmp.path / "resumed").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("started from " + folder.string() +
                                ", a distributed checkpoint without scaletrain's training state "
                                "(as Python's dcp.save writes): its weights and optimizer state "
                                "go on, from epoch 1, step 0"),
            std::string::npos)
      << resumed.output;
  const auto a = metric_losses(tmp.path / "weights"), b = metric_losses(tmp.path / "resumed");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0], a[0]) << "the same weights on the same first batch";
  EXPECT_NE(b[1], a[1]) << "Adam's moments from Python change the first step";
  Model m = make_model("lenet");
  torch::optim::Adam adam(m.module->parameters(), torch::optim::AdamOptions(0.01));
  const auto state =
      load_checkpoint((tmp.path / "resumed" / "ckpt-4").string(), *m.module, adam, "lenet");
  ASSERT_TRUE(state.optimizer_restored);
  const auto& s = static_cast<const torch::optim::AdamParamState&>(
      *adam.state().at(m.module->parameters()[0].unsafeGetTensorImpl()));
  EXPECT_EQ(s.step(), 3 + 4);
  // The folder is Python's own still: nothing was written into it.
  EXPECT_FALSE(fs::exists(folder / ".scaletrain-checkpoint"));
}

// A trainer's checkpoints in PyTorch's layout (--checkpoint-format dcp, two ranks, Adam): Python
// converts the epoch's folder with dcp_to_torch_save and dcp.load's it; its model is model.pt
// bit for bit (the epoch's last step is the run's), and its Adam's state is under
// get_state_dict()'s names.
// The same under zero2 and fsdp (Note [ZeRO's optimizer in checkpoints]): ZeRO's sharded Adam is
// gathered into the folder as the model's own, all 8 of LeNet's parameters with their state.
TEST(DcpInterop, PythonReadsATrainersCheckpointFolder) {
  for (const std::string strategy : {"ddp", "zero2", "fsdp"}) {
    testing::TempDir tmp("dcp_trainer_" + strategy);
    const auto r = testing::run_command(
        testing::cli_path() + " run --nproc-per-node 2 --master-port 0 -- " + testing::cli_path() +
        " train --strategy " + strategy +
        " --device cpu --dataset synthetic --limit-train 256 --limit-test 64 --epochs 1 "
        "--batch-size 64 --optimizer adam --lr 0.002 --checkpoint-format dcp --no-progress "
        "--out " +
        tmp.path.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const fs::path folder = tmp.path / "ckpt-4";  // 256 samples, 64 a step
    ASSERT_TRUE(fs::is_directory(folder)) << r.output;
    const std::string out =
        interop("trainer " + folder.string() + " " + (tmp.path / "model.pt").string());
    EXPECT_TRUE(std::regex_search(out, std::regex("model: 8 tensors equal to model.pt; "
                                                  "optimizer state of 8 parameters \\(exp_avg, "
                                                  "exp_avg_sq, step\\), lr 0.002; global_step 4")))
        << strategy << ": " << out;
    // Note [Checkpoints every rank writes]: ZeRO's ranks each wrote their shards (the weight
    // the shards' bound cuts in several boxes, each rank's file about half); ddp's rank 0 all.
    const auto contents = read_distributed_checkpoint_contents(folder.string());
    size_t most = 0;
    for (const auto& [name, info] : contents.tensors) most = std::max(most, info.chunks.size());
    const bool zero = strategy != "ddp";
    EXPECT_EQ(most > 1, zero) << strategy << ": " << most << " chunks";
    EXPECT_EQ(fs::exists(folder / "__1_0.distcp"), zero) << strategy;
    if (zero) {
      const double a = static_cast<double>(fs::file_size(folder / "__0_0.distcp")),
                   b = static_cast<double>(fs::file_size(folder / "__1_0.distcp"));
      EXPECT_GT(std::min(a, b) / std::max(a, b), 0.8) << strategy << ": " << a << " and " << b;
    }
  }
}

// 2D: fsdp × tp 2 on 4 ranks, the GPT's attention and MLP split over tp and each slice's
// shards over dp. The folder holds each whole parameter under the GPT's names, equal to model.pt,
// and Adam's state of every parameter, each moment's slices and shards joined (Note [Standard
// optimizer state] in src/train/optimizer_states.h); Python reads both.
TEST(DcpInterop, PythonReadsAFsdpTimesTp2FolderWithItsOptimizer) {
  testing::TempDir tmp("dcp_trainer_fsdp_tp2");
  const fs::path text = tmp.path / "text";
  write_byte_tokens("/usr/share/common-licenses/GPL-3", text.string(), 0.1);
  const auto r = testing::run_command(
      testing::cli_path() + " run --nproc-per-node 4 --master-port 0 -- " + testing::cli_path() +
      " train --strategy fsdp --tp 2 --model gpt-tiny --dataset text --data-dir " + text.string() +
      " --device cpu --limit-train 256 --limit-test 64 --epochs 1 --batch-size 64 --optimizer "
      "adam --lr 0.002 --no-progress --out " +
      (tmp.path / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path folder = tmp.path / "out" / "ckpt-4";
  ASSERT_TRUE(fs::is_directory(folder)) << r.output;
  const std::string out =
      interop("trainer " + folder.string() + " " + (tmp.path / "out" / "model.pt").string());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex("model: ([0-9]+) tensors equal to model.pt; "
                                           "optimizer state of ([0-9]+) parameters \\(exp_avg, "
                                           "exp_avg_sq, step\\), lr 0.002; global_step 4")))
      << out;
  const auto params = make_model("gpt-tiny").module->parameters().size();
  EXPECT_EQ(std::stoul(m[2].str()), params) << out;
  EXPECT_GE(std::stoul(m[1].str()), params) << out;
  // Note [Checkpoints every rank writes]: each of the 4 ranks wrote its shards of its slices;
  // the fused q/k/v weight's 3 column chunks are each split over tp, then over dp.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(fs::exists(folder / ("__" + std::to_string(rank) + "_0.distcp"))) << rank;
  }
  const auto contents = read_distributed_checkpoint_contents(folder.string());
  const auto& qkv = contents.tensors.at("model.transformer.h.0.attn.c_attn.weight");
  EXPECT_GE(qkv.chunks.size(), 6u);
}

}  // namespace
}  // namespace scaletrain
