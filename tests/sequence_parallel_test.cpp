// Sequence parallelism in a model of a program's own (tensor_parallel.h; Note [Partial gradients
// summed in backward] in src/tp/sequence_parallel.cpp): the plan sums the gradients of the
// parameters it leaves whole in every backward, so a model that calls nothing after backward
// trains to the single process's weights, and a program that still sums them itself does not
// sum twice. The model follows the header's recipe: a replicated token and position embedding
// looked up on this rank's positions, a LayerNorm and a split MLP on this rank's slice of the
// sequence with coordinated dropout, a replicated head whose logits are gathered along the
// sequence. Float64: Note [Tensor-parallel tolerance] in tensor_parallel_test.cpp bounds two
// groupings of the same arithmetic by 1e-9 of each tensor's largest entry; a missing sum is off
// by about 1e-3 of it.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "scaletrain/coordinated_dropout.h"
#include "scaletrain/data.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

using testing::TempDir;

constexpr int64_t kVocab = 16, kWidth = 8, kContext = 8;

struct SpNetImpl : torch::nn::Module {
  explicit SpNetImpl(double dropout) : p(dropout) {
    using torch::nn::LayerNormOptions;
    tokens = register_module("tokens", torch::nn::Embedding(kVocab, kWidth));
    positions = register_module("positions", torch::nn::Embedding(kContext, kWidth));
    ln = register_module("ln", torch::nn::LayerNorm(LayerNormOptions({kWidth})));
    up = register_module("up", ParallelLinear(kWidth, 4 * kWidth));
    down = register_module("down", ParallelLinear(4 * kWidth, kWidth));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(LayerNormOptions({kWidth})));
    head = register_module("head", torch::nn::Linear(kWidth, kVocab));
  }
  at::Tensor forward(const at::Tensor& ids) {
    const int64_t t = tp ? tp->size() : 1, r = tp ? tp->rank() : 0, n = ids.size(1) / t;
    auto pos = at::arange(r * n, r * n + n, ids.options());
    auto x = tokens(ids.narrow(1, r * n, n)) + positions(pos);  // this rank's positions
    auto h = down(at::gelu(up(ln(x))));
    if (is_training() && p > 0) h = coordinated_dropout(h, {p, {1, t, r}, generator});
    auto logits = head(ln_f(x + h));
    return tp ? gather_from_region(logits, *tp, 1) : logits;  // backward: this rank's slice
  }
  // Sequence parallelism only, so that the recipe above holds (the tests ask for nothing else).
  void parallelize(const Dist& d) {
    parallelize_module(*this, d, {{"up", colwise(1, true)}, {"down", rowwise(true)}});
    tp = std::make_shared<const Dist>(d);
  }

  double p;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(5);  // alike on every rank
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  torch::nn::LayerNorm ln{nullptr}, ln_f{nullptr};
  ParallelLinear up{nullptr}, down{nullptr};
  torch::nn::Linear head{nullptr};
  std::shared_ptr<const Dist> tp;
};
TORCH_MODULE(SpNet);

using State = std::map<std::string, at::Tensor>;

State state_of(torch::nn::Module& m) {
  State out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void load(torch::nn::Module& m, const State& s) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) p.value().copy_(s.at(p.key()));
}

void expect_close(const State& got, const State& want, const std::string& what) {
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": " << name;
    const double bound = 1e-9 * w.abs().max().item<double>() + 1e-13;
    const double err = (got.at(name) - w).abs().max().item<double>();
    EXPECT_LE(err, bound) << what << ": " << name << " off by " << err;
  }
}

// 64 windows of 8 tokens; the task's model a program's own, split by its Model::parallelize and
// nothing else (no after_backward).
struct SpTask {
  Dataset data;
  State start;
  double dropout;
  explicit SpTask(double p) : dropout(p) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(3);
    auto t = at::randint(0, kVocab, {64, kContext + 1}, g, at::kLong);
    data = Dataset{t.narrow(1, 0, kContext).contiguous(), t.narrow(1, 1, kContext).contiguous(),
                   kVocab};
    SpNet m(dropout);
    m->to(at::kDouble);
    start = state_of(*m);
  }
  TrainTask task() const {
    TrainTask t;
    t.train_data = in_memory(data);
    t.model = [this] {
      SpNet net(dropout);
      net->to(at::kDouble);
      load(*net, start);
      Model m = model_of(net.ptr(), "sp-net");
      m.parallelize = [impl = net.ptr()](const Dist& tp, bool) { impl->parallelize(tp); };
      return m;
    };
    t.optimizer = [](const std::vector<at::Tensor>& p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.5));
    };
    return t;
  }
};

State trained(int world, const SpTask& task, TrainerOptions o, const TempDir& dir) {
  o.out_dir = dir.path.string();
  auto errors = testing::run_ranks(world, [&](Dist& d) { train(task.task(), o, d); });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
  SpNet m(0);
  m->to(at::kDouble);
  load_weights((dir.path / "model.pt").string(), *m);
  return state_of(*m);
}

TrainerOptions options() {
  TrainerOptions o;
  o.epochs = 1;
  o.batch_size = 16;
  o.progress = false;
  o.tensorboard = false;
  o.resume = Resume::none();
  o.device = at::kCPU;
  return o;
}

// Regression (SequenceParallelSumForgottenTrainedWrongWeights): a model of a program's own with
// a sequence-parallel plan and no Model::after_backward left its replicated parameters with each
// rank's part of their gradients, and trained to weights 4.8e-3 off the single process's without
// a word. The plan now sums them in backward: tp 2 (with dropout, its masks drawn alike by
// coordinated_dropout) and dp 2 x tp 2 under zero2 train to the single process's weights.
TEST(SequenceParallel, UsersModelWithoutTheGradientSumTrainedToWrongWeights) {
  for (const double p : {0.1, 0.0}) {
    const SpTask task(p);
    TempDir one("sp_one"), split("sp_split");
    const State want = trained(1, task, options(), one);
    auto o = options();
    o.tensor_parallel.size = 2;
    o.tensor_parallel.sequence_parallel = true;
    if (p > 0) {
      expect_close(trained(2, task, o, split), want, "tp 2, dropout");
      continue;  // each replica would draw its own masks: dp 2 compares without dropout
    }
    o.strategy = Strategy::kZero2;
    expect_close(trained(4, task, o, split), want, "dp 2 x tp 2 under zero2");
  }
}

// The whole model's gradients after one backward of the whole batch at tp 1, against a split
// one's after `sum` (what a program calls after backward, if anything).
void expect_whole_gradients(const std::function<void(SpNetImpl&, const Dist&)>& after_backward) {
  const SpTask task(0);
  const auto x = task.data.inputs.narrow(0, 0, 4), y = task.data.targets.narrow(0, 0, 4);
  auto loss = [&](SpNetImpl& m) {
    auto out = m.forward(x);
    return at::cross_entropy_loss(out.reshape({-1, kVocab}), y.reshape({-1}));
  };
  SpNet whole(0);
  whole->to(at::kDouble);
  load(*whole, task.start);
  loss(*whole).backward();
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    SpNet m(0);
    m->to(at::kDouble);
    load(*m, task.start);
    m->parallelize(d);
    loss(*m).backward();
    after_backward(*m, d);
    const auto grads = gather_full_state(*m, d, /*gradients=*/true);
    for (const auto& p : whole->named_parameters()) {
      expect_close({{p.key(), grads.at(p.key())}}, {{p.key(), p.value().grad()}}, "gradient");
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

// A program written before the plan summed the gradients calls sync_sequence_parallel_grads()
// after backward, and registering the sum again does nothing: neither sums a second time.
TEST(SequenceParallel, AnExplicitSumAfterThePlanIsNotASecondOne) {
  expect_whole_gradients([](SpNetImpl&, const Dist&) {});
  expect_whole_gradients([](SpNetImpl& m, const Dist& d) {
    sync_sequence_parallel_grads(replicated_parameters(m), d);
  });
  expect_whole_gradients([](SpNetImpl& m, const Dist& d) {
    sum_partial_gradients(replicated_parameters(m), d);
    sync_sequence_parallel_grads(replicated_parameters(m), d);
  });
}

// A loop that ends its steps in one place defers the sums to one flattened all-reduce per step
// (defer_partial_sums(), what train() does): two backwards accumulate each rank's part, and one
// call after them gives the whole gradients of both batches. Before that call a replicated
// parameter still holds this rank's part alone: the sums were deferred, not done twice.
TEST(SequenceParallel, DeferredSumsAreOneAllReduceAfterTheStepsLastBackward) {
  const SpTask task(0);
  auto loss = [&](SpNetImpl& m, int64_t first) {
    auto x = task.data.inputs.narrow(0, first, 4), y = task.data.targets.narrow(0, first, 4);
    return at::cross_entropy_loss(m.forward(x).reshape({-1, kVocab}), y.reshape({-1}));
  };
  SpNet whole(0);
  whole->to(at::kDouble);
  load(*whole, task.start);
  loss(*whole, 0).backward();
  loss(*whole, 4).backward();
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    SpNet m(0);
    m->to(at::kDouble);
    load(*m, task.start);
    m->parallelize(d);
    const auto partial = replicated_parameters(*m);
    defer_partial_sums(partial);
    loss(*m, 0).backward();
    loss(*m, 4).backward();
    ASSERT_FALSE(partial.empty());
    const auto& norm = m->ln->weight;
    EXPECT_FALSE(at::allclose(norm.grad(), whole->ln->weight.grad())) << "summed already";
    sum_deferred_partial_gradients(partial, d);
    const auto grads = gather_full_state(*m, d, /*gradients=*/true);
    for (const auto& p : whole->named_parameters()) {
      expect_close({{p.key(), grads.at(p.key())}}, {{p.key(), p.value().grad()}}, "gradient");
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

// A parameter left whole by a first sequence-parallel plan and split by a second has its sum
// turned off (a slice's gradient is whole already).
TEST(SequenceParallel, APlanThatSplitsAParameterTurnsItsSumOff) {
  const SpTask task(0);
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    SpNet once(0), twice(0);
    for (SpNet* m : {&once, &twice}) {
      (*m)->to(at::kDouble);
      load(**m, task.start);
    }
    once->parallelize(d);
    parallelize_module(*twice, d, {{"up", colwise(1, true)}});  // "down" left whole, summed
    parallelize_module(*twice, d, {{"down", rowwise(true)}});   // now split: not summed
    twice->tp = once->tp;
    const auto x = task.data.inputs.narrow(0, 0, 4);
    once->forward(x).pow(2).sum().backward();
    twice->forward(x).pow(2).sum().backward();
    EXPECT_TRUE(at::equal(twice->down->weight.grad(), once->down->weight.grad()));
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

}  // namespace
}  // namespace scaletrain
