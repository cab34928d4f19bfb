// Model weights shared with Python PyTorch, both ways: scaletrain's state dict loads into the
// Python model of the seeds with load_state_dict(strict=True) and gives the same outputs, and
// a state dict saved by Python loads into scaletrain's model with the same outputs.

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/tolerance.h"
#include "support/zoo.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::string python() { return std::string(VENV_DIR) + "/bin/python"; }

void write_io(const fs::path& p, const at::Tensor& x, const at::Tensor& y) {
  c10::Dict<std::string, at::Tensor> d;
  d.insert("x", x);
  d.insert("y", y);
  auto bytes = torch::pickle_save(d);
  std::ofstream(p, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::pair<at::Tensor, at::Tensor> read_io(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto d = torch::pickle_load(bytes).toGenericDict();
  return {d.at("x").toTensor(), d.at("y").toTensor()};
}

std::map<std::string, at::Tensor> state(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value();
  for (auto& b : m.named_buffers()) out[b.key()] = b.value();
  return out;
}

// A model whose batch-norm statistics have moved off their defaults, in eval mode.
Model warmed(const std::string& name, uint64_t seed) {
  torch::manual_seed(seed);
  Model m = make_model(name);
  torch::NoGradGuard no_grad;
  m.forward(at::randn({4, 1, 28, 28}) * 2 + 1);
  m.module->eval();
  return m;
}

TEST(Weights, RoundTripKeepsEveryParameterAndBuffer) {
  testing::TempDir dir("weights");
  Model a = warmed("resnet18", 1), b = warmed("resnet18", 2);
  save_weights((dir.path / "w.pt").string(), *a.module);
  load_weights((dir.path / "w.pt").string(), *b.module);
  auto sa = state(*a.module), sb = state(*b.module);
  ASSERT_EQ(sa.size(), sb.size());
  for (auto& [k, v] : sa) EXPECT_TRUE(at::equal(v, sb[k])) << k;
}

TEST(Weights, AnotherModelsWeightsAreRefusedByName) {
  testing::TempDir dir("weights");
  Model lenet = make_model("lenet"), mlp = make_model("mlp");
  save_weights((dir.path / "w.pt").string(), *lenet.module);
  const auto before = mlp.module->parameters()[0].clone();
  try {
    load_weights((dir.path / "w.pt").string(), *mlp.module);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("unexpected keys: conv1.bias"), std::string::npos) << m;
    EXPECT_NE(m.find("shape mismatches: fc1.weight (file [128, 800], model [256, 784])"),
              std::string::npos)
        << m;
  }
  EXPECT_TRUE(at::equal(before, mlp.module->parameters()[0])) << "changed by a failed load";
  EXPECT_THROW(load_weights((dir.path / "none.pt").string(), *mlp.module), Error);
}

// (model, weights file name): .pt is torch.save's format, .safetensors safetensors.
class PythonInterop : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  std::string model() const { return std::get<0>(GetParam()); }
  std::string file() const { return std::get<1>(GetParam()); }
};

// Both sides' outputs against the exact (float64) output of the model with these weights and
// batch-norm statistics (Note [Tolerances]).
void expect_exact_outputs(const Model& m, const at::Tensor& x,
                          const std::vector<std::pair<std::string, at::Tensor>>& outputs) {
  auto zoo = testing::zoo_reference(m.name, {}, /*eval=*/true);
  auto exact = testing::exact_and_magnitudes(
      zoo.make, zoo.forward, testing::weights_of(*m.module), x,
      [](const at::Tensor& out, const at::Tensor&) {
        return testing::LossGradient{at::zeros_like(out), at::zeros_like(out)};
      },
      testing::buffers_of(*m.module));
  const double terms = testing::forward_terms(*m.module) + 16;  // + the final average pool
  for (const auto& [who, y] : outputs) {
    EXPECT_TRUE(testing::within_rounding(y, exact.output, exact.output_magnitude, terms)) << who;
  }
}

TEST_P(PythonInterop, PythonLoadsOurWeightsAndGetsOurOutputs) {
  testing::TempDir dir("weights");
  Model m = warmed(model(), 3);
  auto x = at::randn({4, 1, 28, 28});
  at::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = m.forward(x);
  }
  save_weights((dir.path / file()).string(), *m.module);
  write_io(dir.path / "io.pt", x, y);
  auto r = testing::run_command(python() + " " + testing::script_path("interop.py") + " run " +
                                model() + " " + (dir.path / file()).string() + " " +
                                (dir.path / "io.pt").string() + " " +
                                (dir.path / "out.pt").string() + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto [unused, y_python] = read_io(dir.path / "out.pt");
  expect_exact_outputs(m, x, {{"scaletrain", y}, {"Python", y_python}});
}

TEST_P(PythonInterop, WeLoadPythonsWeightsAndGetItsOutputs) {
  testing::TempDir dir("weights");
  auto r = testing::run_command(python() + " " + testing::script_path("interop.py") + " make " +
                                model() + " " + (dir.path / file()).string() + " " +
                                (dir.path / "io.pt").string() + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Model m = make_model(model());
  load_weights((dir.path / file()).string(), *m.module);
  m.module->eval();
  auto [x, y] = read_io(dir.path / "io.pt");
  at::Tensor ours;
  {
    torch::NoGradGuard no_grad;
    ours = m.forward(x);
  }
  expect_exact_outputs(m, x, {{"scaletrain", ours}, {"Python", y}});
}

INSTANTIATE_TEST_SUITE_P(Models, PythonInterop,
                         ::testing::Combine(::testing::Values("lenet", "resnet18"),
                                            ::testing::Values("w.pt", "w.safetensors")));

// A bare model.state_dict() is an OrderedDict, which LibTorch's unpickler cannot rebuild: the
// error says how to save instead.
TEST(Weights, AnOrderedDictGetsAnErrorWithTheFix) {
  testing::TempDir dir("weights");
  const std::string w = (dir.path / "ordered.pt").string();
  auto r = testing::run_command(
      python() + " -c 'import torch; torch.save(torch.nn.Linear(2, 3).state_dict(), \"" + w +
      "\")' 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  torch::nn::Linear lin(2, 3);
  try {
    load_weights(w, *lin);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("torch.save(dict(model.state_dict()), path)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Weights, SafetensorsRoundTripAndCorruption) {
  testing::TempDir dir("weights");
  Model a = warmed("lenet", 1), b = warmed("lenet", 2);
  const std::string w = (dir.path / "w.safetensors").string();
  save_weights(w, *a.module);
  load_weights(w, *b.module);
  auto sa = state(*a.module), sb = state(*b.module);
  for (auto& [k, v] : sa) EXPECT_TRUE(at::equal(v, sb[k])) << k;
  fs::resize_file(w, fs::file_size(w) - 10);  // truncated: the last tensor no longer fits
  EXPECT_THROW(load_weights(w, *b.module), Error);
}

}  // namespace
}  // namespace scaletrain
