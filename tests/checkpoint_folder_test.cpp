// Checkpoints as folders in PyTorch's distributed checkpoint layout (CheckpointLayout::kDcp,
// checkpoint.h): what save_checkpoint() writes loads back bit for bit with the whole training
// state; pruning counts a run's files and folders together and leaves other runs' alone; a
// damaged folder is skipped for the newest good one; the background writer's snapshot is taken
// when save() returns. tests/dcp_interop_test.cpp reads a trainer's folder with Python.

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "scaletrain/checkpoint.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// A linear layer after two steps of `opt`, and a training state of `run` at `step`.
struct Trained {
  torch::nn::Linear model{torch::nn::LinearOptions(6, 3)};
  torch::optim::SGD opt{model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  TrainingState state;

  Trained(const std::string& run, int64_t step) {
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      model->forward(at::randn({4, 6})).pow(2).mean().backward();
      opt.step();
    }
    state.run_id = run;
    state.model_name = "linear";
    state.epoch = 1;
    state.step_in_epoch = step % 5;
    state.global_step = step;
    state.sampler = {1, 64 * (step % 5), 320};
    state.tensors = rng_state();
    state.tensors["scaler/scale"] = at::tensor({1024.0}, at::kDouble);
    state.values["trainer/seed"] = "7";
  }
};

void flip_a_byte(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(40);
  char c = 0;
  f.read(&c, 1);
  f.seekp(40);
  c = static_cast<char>(c ^ 0x5a);
  f.write(&c, 1);
}

TEST(CheckpointFolder, LoadsBackTheWholeTrainingStateBitForBit) {
  testing::TempDir tmp("ckpt_folder_load");
  torch::manual_seed(3);
  Trained a("run-a", 7);
  const std::string path =
      save_checkpoint(tmp.path.string(), a.state, *a.model, &a.opt, 3, CheckpointLayout::kDcp);
  EXPECT_EQ(path, (tmp.path / "ckpt-7").string());
  EXPECT_TRUE(fs::exists(tmp.path / "ckpt-7" / ".metadata"));
  EXPECT_EQ(checkpoint_problem(path), std::nullopt);
  EXPECT_EQ(checkpoint_run(path), "run-a");
  EXPECT_EQ(checkpoint_value(path, "trainer/seed"), "7");

  torch::manual_seed(99);
  Trained b("run-b", 1);
  const TrainingState s = load_checkpoint(path, *b.model, &b.opt, "linear");
  EXPECT_TRUE(s.optimizer_restored);
  EXPECT_EQ(s.run_id, "run-a");
  EXPECT_EQ(s.epoch, 1);
  EXPECT_EQ(s.step_in_epoch, 2);
  EXPECT_EQ(s.global_step, 7);
  EXPECT_EQ(s.sampler.position, 128);
  EXPECT_EQ(s.sampler.dataset_size, 320);
  EXPECT_EQ(s.values, a.state.values);
  ASSERT_EQ(s.tensors.size(), a.state.tensors.size());
  for (const auto& [k, t] : a.state.tensors) EXPECT_TRUE(at::equal(s.tensors.at(k), t)) << k;
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
    const auto& ma = static_cast<const torch::optim::SGDParamState&>(
        *a.opt.state().at(pa[i].unsafeGetTensorImpl()));
    const auto& mb = static_cast<const torch::optim::SGDParamState&>(
        *b.opt.state().at(pb[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(at::equal(ma.momentum_buffer(), mb.momentum_buffer())) << "parameter " << i;
  }
  // Python's names: the model's and get_state_dict()'s.
  const auto contents = read_distributed_checkpoint_contents(path);
  EXPECT_EQ(contents.tensors.count("model.weight"), 1u);
  EXPECT_EQ(contents.tensors.count("optim.state.weight.momentum_buffer"), 1u);
  EXPECT_EQ(contents.tensors.count("scaletrain.tensors.scaler/scale"), 1u);

  // Another model's name is refused, as for a file.
  Trained c("run-c", 1);
  EXPECT_THROW(load_checkpoint(path, *c.model, &c.opt, "lenet"), UsageError);
}

TEST(CheckpointFolder, PruningCountsTheRunsFilesAndFoldersAndLeavesOtherRunsAlone) {
  testing::TempDir tmp("ckpt_folder_prune");
  const std::string dir = tmp.path.string();
  Trained other("other-run", 1);
  save_checkpoint(dir, other.state, *other.model, &other.opt, 1, CheckpointLayout::kDcp);
  Trained t("run-a", 2);
  save_checkpoint(dir, t.state, *t.model, &t.opt, 2);  // a file first: ckpt-2.st
  for (int64_t step : {3, 4, 5}) {
    t.state.global_step = step;
    save_checkpoint(dir, t.state, *t.model, &t.opt, 2, CheckpointLayout::kDcp);
  }
  std::set<std::string> names;
  for (auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"ckpt-1", "ckpt-4", "ckpt-5"}));
  EXPECT_EQ(newest_valid_checkpoint(dir), (tmp.path / "ckpt-5").string());
}

TEST(CheckpointFolder, ADamagedFolderIsSkippedForTheNewestGoodOne) {
  testing::TempDir tmp("ckpt_folder_damaged");
  const std::string dir = tmp.path.string();
  Trained t("run-a", 2);
  save_checkpoint(dir, t.state, *t.model, &t.opt, 5, CheckpointLayout::kDcp);
  t.state.global_step = 3;
  save_checkpoint(dir, t.state, *t.model, &t.opt, 5);  // ckpt-3.st
  t.state.global_step = 4;
  save_checkpoint(dir, t.state, *t.model, &t.opt, 5, CheckpointLayout::kDcp);
  flip_a_byte(tmp.path / "ckpt-4" / "__0_0.distcp");
  EXPECT_EQ(checkpoint_problem((tmp.path / "ckpt-4").string()),
            "is corrupt (checksum mismatch in __0_0.distcp)");
  EXPECT_EQ(newest_valid_checkpoint(dir), (tmp.path / "ckpt-3.st").string());
  fs::remove(tmp.path / "ckpt-3.st");
  fs::resize_file(tmp.path / "ckpt-2" / "__0_0.distcp", 100);
  EXPECT_EQ(newest_valid_checkpoint(dir), std::nullopt);
  // A folder of that name that scaletrain did not write (no record) is no checkpoint.
  fs::create_directory(tmp.path / "ckpt-9");
  EXPECT_EQ(checkpoint_problem((tmp.path / "ckpt-9").string()),
            "has no record of its files (.scaletrain-checkpoint): not a complete scaletrain "
            "checkpoint");
  Trained u("run-u", 1);
  try {
    load_checkpoint((tmp.path / "ckpt-4").string(), *u.model, &u.opt, "linear");
    ADD_FAILURE() << "a damaged folder loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt-4' is corrupt (checksum mismatch"),
              std::string::npos)
        << e.what();
  }
}

// The background writer: the folder holds the state of the moment save() returned, whatever
// the training does to the model and optimizer while it is written; an Adam goes under
// get_state_dict()'s names with its step.
TEST(CheckpointFolder, TheBackgroundWriterSavesTheStateSaveWasCalledWith) {
  testing::TempDir tmp("ckpt_folder_async");
  torch::nn::Linear m(torch::nn::LinearOptions(6, 3));
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01));
  auto step = [&] {
    opt.zero_grad();
    m->forward(at::randn({4, 6})).pow(2).mean().backward();
    opt.step();
  };
  step();
  TrainingState s;
  s.run_id = "run-a";
  s.model_name = "linear";
  s.global_step = 1;
  const at::Tensor before = m->weight.detach().clone();
  AsyncCheckpointOptions ao;
  ao.layout = CheckpointLayout::kDcp;
  AsyncCheckpointer writer(ao);
  const std::string path = writer.save(tmp.path.string(), s, *m, &opt, 3);
  EXPECT_EQ(path, (tmp.path / "ckpt-1").string());
  step();  // changes the weights and the moments in place
  writer.wait();
  EXPECT_EQ(writer.last_written(), path);
  torch::nn::Linear back(torch::nn::LinearOptions(6, 3));
  torch::optim::Adam back_opt(back->parameters(), torch::optim::AdamOptions(0.01));
  const TrainingState got = load_checkpoint(path, *back, &back_opt, "linear");
  EXPECT_TRUE(got.optimizer_restored);
  EXPECT_TRUE(at::equal(back->weight, before));
  const auto& st = static_cast<const torch::optim::AdamParamState&>(
      *back_opt.state().at(back->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(st.step(), 1);
  EXPECT_EQ(read_distributed_checkpoint_contents(path).tensors.count("optim.state.weight.step"),
            1u);
}

}  // namespace
}  // namespace scaletrain
