#pragma once
// Token models trained at one layout against another (the trainer's transparency tests of the
// cp and ep dimensions): 64 windows of 8 tokens of a 16-token vocabulary with next-token targets,
// one set of float64 starting weights of a zoo model, train() on thread ranks, and the
// comparison of two runs.
//
// Note [Token run tolerance]: float64; each test's own note bounds one step's difference between
// the layouts (regrouped sums) at about 1e-13 of the scale, and after 8 steps the weights agree
// within 1e-9 of each tensor's largest entry (+1e-13 for tensors near zero); a gradient averaged
// over the wrong ranks or a block left out is off by 1e-3 of it or more.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "zoo_models.h"

namespace scaletrain::testing {

struct ZooTokens {
  std::string name;
  ModelOptions options;  // vocabulary 16 and context 8 unless the caller sets them
  Dataset train, test;
  std::map<std::string, at::Tensor> start;

  ZooTokens(std::string model, ModelOptions mo, uint64_t seed)
      : name(std::move(model)), options(mo) {
    if (options.vocab_size == 0) options.vocab_size = 16;
    if (options.context == 0) options.context = 8;
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto tokens = at::randint(0, 16, {64, 9}, g, at::kLong);
    train = Dataset{tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous(), 16};
    test = Dataset{train.inputs.narrow(0, 0, 16), train.targets.narrow(0, 0, 16), 16};
    Model m = make_model(name, options);
    m.module->to(at::kDouble);
    for (const auto& p : m.module->named_parameters()) start[p.key()] = p.value().detach().clone();
  }
  /// The task: the data, and the model built with `mo` (the struct's options by default) from
  /// the starting weights.
  TrainTask task() const { return task(options); }
  TrainTask task(const ModelOptions& mo) const {
    TrainTask t;
    t.train_data = in_memory(train);
    t.test_data = in_memory(test);
    t.model = [this, mo] {
      Model m = make_model(name, mo);
      m.module->to(at::kDouble);
      torch::NoGradGuard no_grad;
      for (auto& p : m.module->named_parameters()) p.value().copy_(start.at(p.key()));
      return m;
    };
    return t;
  }
  std::map<std::string, at::Tensor> weights_of(const std::string& path) const {
    Model m = make_model(name, options);
    m.module->to(at::kDouble);
    load_weights(path, *m.module);
    std::map<std::string, at::Tensor> out;
    for (const auto& p : m.module->named_parameters()) out[p.key()] = p.value().detach().clone();
    return out;
  }
};

/// Two epochs of batches of 16 on the CPU into `out`, quietly, from scratch.
inline TrainerOptions token_run_options(const std::filesystem::path& out) {
  TrainerOptions o;
  o.epochs = 2;
  o.batch_size = 16;
  o.progress = false;
  o.tensorboard = false;
  o.out_dir = out.string();
  o.resume = Resume::none();
  o.device = at::kCPU;
  return o;
}

/// train() on `world` thread ranks; rank 0's result (every rank must return normally).
inline TrainResult run_world(int world, const TrainTask& task, const TrainerOptions& o) {
  TrainResult r;
  auto errors = run_ranks(world, [&](Dist& d) {
    auto mine = train(task, o, d);
    if (d.rank() == 0) r = mine;
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
  return r;
}

/// The weights of two runs' model.pt, tensor by tensor (Note [Token run tolerance]).
inline void expect_same_weights(const ZooTokens& data, const std::string& got,
                                const std::string& want, const std::string& what) {
  const auto a = data.weights_of(got), b = data.weights_of(want);
  for (const auto& [name, w] : b) {
    const double bound = 1e-9 * w.abs().max().item<double>() + 1e-13;
    const double err = (a.at(name) - w).abs().max().item<double>();
    EXPECT_LE(err, bound) << what << ": " << name << " off by " << err;
  }
}

/// The same steps, loss, accuracy and weights.
inline void expect_same_run(const ZooTokens& data, const TrainResult& got, const TrainResult& want,
                            const std::string& what) {
  EXPECT_EQ(got.global_step, want.global_step) << what;
  EXPECT_NEAR(got.final_loss, want.final_loss, 1e-9 * want.final_loss) << what;
  EXPECT_NEAR(got.test_accuracy, want.test_accuracy, 1e-12) << what;
  expect_same_weights(data, got.weights_path, want.weights_path, what);
}

/// The first rank's error of train() on `world` thread ranks ("" when it returned).
inline std::string train_error(int world, const TrainTask& task, const TrainerOptions& o) {
  auto errors = run_ranks(world, [&](Dist& d) { train(task, o, d); });
  return errors.at(0);
}

/// train() on `world` thread ranks with `o`, expecting the first rank's error to hold `part`
/// (overwrite on: a run refused in its ranks leaves its folder's first files).
inline void expect_train_error(int world, TrainerOptions o, const std::string& part,
                               const TrainTask& task) {
  o.overwrite = true;
  const std::string e = train_error(world, task, o);
  EXPECT_NE(e.find(part), std::string::npos) << "wanted '" << part << "' in: " << e;
}

/// train() on `world` thread ranks, stopped by an exception in the hook of step `step` (after
/// its checkpoint, with checkpoint_every 1): a run to resume.
inline void stop_at_step(int world, TrainTask task, const TrainerOptions& o, int64_t step) {
  const std::string stop = "stopped at step " + std::to_string(step);
  task.on_step = [&](const StepReport& r) {
    if (r.global_step == step) throw std::runtime_error(stop);
  };
  const auto stopped = run_ranks(world, [&](Dist& d) { train(task, o, d); });
  for (const auto& e : stopped) ASSERT_EQ(e, stop);
}

}  // namespace scaletrain::testing
