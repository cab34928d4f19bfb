// Pipeline transparency: outputs, loss and gradients of the pipelined model are the whole
// model's for GPipe and 1F1B, 2 to 4 stages on repeated CPU devices, and micro-batch counts that
// do and do not divide the batch (Note [Tolerances]: against the exact float64 values, with the
// bound of their arithmetic).

#include "scaletrain/pipeline.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <mutex>
#include <set>
#include <thread>

#include "pipeline/split_backward.h"
#include "scaletrain/error.h"
#include "scaletrain/intra_op_threads.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

torch::nn::Sequential seq_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

at::Tensor run_sequential(torch::nn::Module& m, const at::Tensor& x) {
  return static_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

// Terms along seq_model()'s longest chain for a batch of `rows` cut into `chunks`: forward
// fan-ins 9, 17, 17; the loss 3; backward fan-outs 16, 4; the batch; the micro-batches' weighted
// losses and summed gradients.
double terms(int64_t rows, int chunks) {
  return 9 + 17 + 17 + 3 + 16 + 4 + static_cast<double>(rows) + 2 * chunks;
}

struct Case {
  std::vector<int> balance;
  int chunks;
  PipelineSchedule schedule;
  PipelineCheckpoint checkpoint = PipelineCheckpoint::kNever;
  int per_device = 1;  // interleaved: stages per device
};

class PipelineTransparency : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineTransparency, OutputsAndGradientsEqualTheWholeModel) {
  const Case c = GetParam();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = at::randn({10, 8}, gen), y = at::randn({10, 4}, gen);
  const double k = terms(10, c.chunks);
  auto exact =
      testing::exact_and_magnitudes([] { return seq_model().ptr(); }, run_sequential,
                                    testing::weights_of(*seq_model()), x, testing::mse_gradient(y));

  PipelineOptions o;
  o.balance = c.balance;
  o.devices.assign(c.balance.size() / static_cast<size_t>(c.per_device), at::Device(at::kCPU));
  o.stages_per_device = c.per_device;
  o.chunks = c.chunks;
  o.schedule = c.schedule;
  o.checkpoint = c.checkpoint;
  Pipeline pipe(seq_model(), o);
  {
    torch::NoGradGuard g;
    EXPECT_TRUE(testing::within_rounding(pipe.forward(x), exact.output, exact.output_magnitude, k));
  }
  auto loss = pipe.train_step(x, y, mse);
  auto value = testing::mse_value(exact, y);
  EXPECT_TRUE(testing::within_rounding(loss, value.exact, value.magnitude, k));
  std::vector<at::Tensor> got;
  for (auto& st : pipe.stages()) {
    for (auto& p : st->parameters()) got.push_back(p.grad());
  }
  testing::expect_gradients_within_rounding(got, exact, k, "pipeline");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PipelineTransparency,
    ::testing::Values(
        Case{{2, 3}, 1, PipelineSchedule::kGPipe}, Case{{2, 3}, 4, PipelineSchedule::kGPipe},
        Case{{2, 3}, 3, PipelineSchedule::k1F1B},  // 3 does not divide 10
        Case{{1, 2, 2}, 5, PipelineSchedule::kGPipe}, Case{{1, 2, 2}, 4, PipelineSchedule::k1F1B},
        Case{{1, 1, 1, 2}, 3, PipelineSchedule::kGPipe},
        Case{{1, 1, 1, 2}, 10, PipelineSchedule::k1F1B},
        // Activation checkpointing: recomputed forwards give the same gradients.
        Case{{2, 3}, 4, PipelineSchedule::kGPipe, PipelineCheckpoint::kAlways},
        Case{{2, 3}, 3, PipelineSchedule::k1F1B, PipelineCheckpoint::kExceptLast},
        Case{{1, 2, 2}, 4, PipelineSchedule::kGPipe, PipelineCheckpoint::kExceptLast},
        Case{{1, 1, 1, 2}, 3, PipelineSchedule::k1F1B, PipelineCheckpoint::kAlways},
        // Interleaved 1F1B: 4 stages on 2 devices, 3 on 3 (one per device).
        Case{{1, 1, 1, 2}, 4, PipelineSchedule::kInterleaved1F1B, PipelineCheckpoint::kNever, 2},
        Case{{1, 1, 1, 2},
             2,
             PipelineSchedule::kInterleaved1F1B,
             PipelineCheckpoint::kExceptLast,
             2},
        Case{{1, 2, 2}, 3, PipelineSchedule::kInterleaved1F1B},
        // Zero bubble H1: the backward split into input and weight gradients.
        Case{{2, 3}, 3, PipelineSchedule::kZeroBubbleH1},
        Case{{1, 2, 2}, 4, PipelineSchedule::kZeroBubbleH1},
        Case{{1, 1, 1, 2}, 10, PipelineSchedule::kZeroBubbleH1},
        Case{{2, 3}, 4, PipelineSchedule::kZeroBubbleH1, PipelineCheckpoint::kExceptLast}));

// Note [Stage threads]: one thread per device, kept from step to step; and a second step
// accumulates onto the first's gradients under every schedule.
TEST(Pipeline, StageThreadsPersistAcrossSteps) {
  for (auto schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B,
                        PipelineSchedule::kInterleaved1F1B, PipelineSchedule::kZeroBubbleH1}) {
    std::mutex mu;
    std::vector<std::set<std::thread::id>> seen(2);
    int step = 0;
    auto spy = torch::nn::Functional([&](const at::Tensor& t) {
      std::lock_guard lock(mu);
      seen[static_cast<size_t>(step)].insert(std::this_thread::get_id());
      return t;
    });
    auto model = seq_model();
    model->push_back(spy);  // 6 layers
    PipelineOptions o;
    o.balance = schedule == PipelineSchedule::kInterleaved1F1B ? std::vector<int>{1, 2, 2, 1}
                                                               : std::vector<int>{3, 3};
    o.stages_per_device = schedule == PipelineSchedule::kInterleaved1F1B ? 2 : 1;
    o.devices = {at::kCPU, at::kCPU};
    o.chunks = 4;
    o.schedule = schedule;
    Pipeline pipe(model, o);
    auto x = at::randn({8, 8}), y = at::randn({8, 4});
    pipe.train_step(x, y, mse);
    auto first = pipe.stages()[0]->parameters()[0].grad().clone();
    step = 1;
    pipe.train_step(x, y, mse);
    EXPECT_EQ(seen[0].size(), 1u) << "the spy runs on the last device's thread";
    EXPECT_EQ(seen[0], seen[1]) << "a new thread ran the second step";
    EXPECT_EQ(seen[0].count(std::this_thread::get_id()), 0u);
    auto second = pipe.stages()[0]->parameters()[0].grad();
    EXPECT_TRUE(at::allclose(second, 2 * first, 1e-5, 1e-6)) << "gradients accumulate";
  }
}

TEST(Pipeline, InterleavedNeedsItsScheduleAndWholeRounds) {
  PipelineOptions o;
  o.balance = {1, 1, 1, 2};
  o.devices = {at::kCPU, at::kCPU};
  o.stages_per_device = 2;
  EXPECT_THROW(Pipeline(seq_model(), o), UsageError);  // GPipe with 2 stages per device
  o.schedule = PipelineSchedule::kInterleaved1F1B;
  o.chunks = 3;  // not a multiple of 2 devices
  try {
    Pipeline pipe(seq_model(), o);
    FAIL() << "expected an error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("use a multiple of 2"), std::string::npos) << e.what();
  }
}

// Regression (interleaved short batch): a batch smaller than the chunks (a trainer's last
// batch) gives 3 micro-batches on 2 devices, not whole rounds; the step runs fill-drain over the
// chunks instead of failing mid-epoch, with the whole model's gradients.
TEST(Pipeline, InterleavedShortBatchRunsFillDrain) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({3, 8}, gen), y = at::randn({3, 4}, gen);
  auto exact =
      testing::exact_and_magnitudes([] { return seq_model().ptr(); }, run_sequential,
                                    testing::weights_of(*seq_model()), x, testing::mse_gradient(y));
  PipelineOptions o;
  o.balance = {1, 1, 1, 2};
  o.devices = {at::kCPU, at::kCPU};
  o.stages_per_device = 2;
  o.schedule = PipelineSchedule::kInterleaved1F1B;
  o.chunks = 4;
  Pipeline pipe(seq_model(), o);
  pipe.train_step(x, y, mse);
  std::vector<at::Tensor> got;
  for (auto& st : pipe.stages()) {
    for (auto& p : st->parameters()) got.push_back(p.grad());
  }
  testing::expect_gradients_within_rounding(got, exact, terms(3, 3), "3 micro-batches");
}

// Checkpointing really drops the graph: with every micro-batch checkpointed, a forward keeps no
// autograd graph, which shows as outputs without a grad_fn at the stage boundary. Measured in
// bytes by `scaletrain bench pipeline-memory`.
TEST(Pipeline, CheckpointedForwardRecordsNoGraph) {
  PipelineOptions o;
  o.balance = {2, 3};
  o.devices = {at::kCPU, at::kCPU};
  o.chunks = 2;
  o.checkpoint = PipelineCheckpoint::kAlways;
  Pipeline pipe(seq_model(), o);
  std::vector<bool> had_graph;
  auto probe = [&](const at::Tensor& out, const at::Tensor& y) {
    had_graph.push_back(out.requires_grad());
    return mse(out, y);
  };
  pipe.train_step(at::randn({4, 8}), at::randn({4, 4}), probe);
  // Each micro-batch's loss is computed twice: without a graph in the forward, with one in the
  // recomputation before its backward.
  EXPECT_EQ(had_graph, (std::vector<bool>{false, false, true, true}));
}

// device_map="auto" on repeated CPU devices: the budgets force a split, and the placed
// pipeline is still the model.
TEST(Pipeline, PlacedByMemoryAndStillTheModel) {
  // Layer bytes: Linear(8,16) 576, ReLU 0, Linear(16,16) 1088, ReLU 0, Linear(16,4) 272.
  std::string report;
  auto o = place_by_memory(seq_model(), {{"cpu", 1700}, {"cpu", 1700}}, &report);
  EXPECT_EQ(o.balance, (std::vector<int>{4, 1}));
  ASSERT_EQ(o.devices.size(), 2u);
  EXPECT_EQ(report,
            "cpu: layers 0-3, 1664 B, 416 parameters\ncpu: layer 4, 272 B, 68 parameters\n");
  auto x = at::randn({6, 8});
  Pipeline pipe(seq_model(), o);
  torch::NoGradGuard g;
  // One micro-batch: the same kernels on the same batch as the model itself.
  EXPECT_TRUE(at::equal(pipe.forward(x), seq_model()->forward(x)));
  EXPECT_THROW(place_by_memory(seq_model(), {{"cpu", 1000}}), UsageError);
}

// A model with one heavy layer: profiling finds it (by a wide margin: ~1000x the work of the
// small ones) and the time balance gives it a stage of its own.
TEST(Pipeline, BalanceByTimeIsolatesTheHeavyLayer) {
  torch::manual_seed(0);
  // One intra-op thread: on a many-core machine the big layer is spread over every core and
  // the tiny ones are all overhead, which blurs the contrast the test relies on.
  IntraOpThreads one_thread(1);
  torch::nn::Sequential m(torch::nn::Linear(32, 32), torch::nn::Linear(32, 32),
                          torch::nn::Linear(32, 1024), torch::nn::Linear(1024, 1024),
                          torch::nn::Linear(1024, 32));
  auto sample = at::randn({256, 32});
  auto prof = profile_layers(m, sample, 5);
  ASSERT_EQ(prof.size(), 5u);
  EXPECT_GT(prof[3].seconds, 5 * prof[0].seconds);
  EXPECT_EQ(prof[2].activation_bytes, 256 * 1024 * 4);
  EXPECT_EQ(prof[3].parameter_bytes, (1024 * 1024 + 1024) * 4);
  for (auto& p : m->parameters()) EXPECT_FALSE(p.grad().defined());
  auto balance = balance_by_time(m, sample, 3, 5);
  ASSERT_EQ(balance.size(), 3u);
  EXPECT_EQ(balance[0] + balance[1] + balance[2], 5);
  // The stage holding layer 3 holds nothing else unless the rest fits in one stage.
  int first = 0;
  for (int b : balance) {
    if (first <= 3 && 3 < first + b) {
      EXPECT_LE(b, 2) << "layer 3 shares its stage";
    }
    first += b;
  }
  // By parameter bytes: 1056, 1056, 33792, 1049600, 32800 -> the big one alone.
  EXPECT_EQ(balance_by_size(m, 3), (std::vector<int>{3, 1, 1}));
}

TEST(Pipeline, SplitSizeSetsTheMicrobatchCount) {
  PipelineOptions o;
  o.balance = {2, 3};
  o.devices = {at::kCPU, at::kCPU};
  o.split_size = 4;  // batch 10 -> 3 micro-batches of 4, 3, 3
  Pipeline pipe(seq_model(), o);
  std::vector<int64_t> sizes;
  pipe.train_step(at::randn({10, 8}), at::randn({10, 4}),
                  [&](const at::Tensor& out, const at::Tensor& y) {
                    sizes.push_back(out.size(0));
                    return mse(out, y);
                  });
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 3, 3}));
}

TEST(Pipeline, MicrobatchSplitsCoverTheBatch) {
  auto parts = split_microbatches(at::arange(10), 4);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].size(0), 3);
  EXPECT_EQ(parts[3].size(0), 2);
  EXPECT_TRUE(at::equal(at::cat(parts), at::arange(10)));
  EXPECT_EQ(split_microbatches(at::arange(2), 5).size(), 2u);
}

TEST(Pipeline, StageExceptionIsRaisedOnTheCaller) {
  // Stage 1 expects 5 features but gets 16: its thread fails, the caller sees which stage.
  torch::nn::Sequential bad(torch::nn::Linear(8, 16), torch::nn::Linear(5, 4));
  PipelineOptions o;
  o.balance = {1, 1};
  o.devices = {at::kCPU, at::kCPU};
  o.chunks = 2;
  Pipeline pipe(bad, o);
  try {
    pipe.train_step(at::randn({4, 8}), at::randn({4, 4}), mse);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline stage 1 (cpu) failed"), std::string::npos)
        << e.what();
  }
}

TEST(Pipeline, BadBalanceIsRefused) {
  PipelineOptions o;
  o.balance = {2, 2};
  o.devices = {at::kCPU, at::kCPU};
  EXPECT_THROW(Pipeline(seq_model(), o), UsageError);  // 4 of 5 layers
  o.balance = {2, 3};
  o.devices = {at::kCPU};
  EXPECT_THROW(Pipeline(seq_model(), o), UsageError);
}

// Note [Split backward]: I then W give one whole backward's gradients, the same operations on
// the same values, so bit for bit; with layers without weights after a weighted one (a Tanh, a
// frozen Linear, a dropout; an in-place ReLU), a stage's input with and without a gradient.
// And what those layers saved is freed at I, not kept until W.
TEST(SplitBackward, InputThenWeightGradientsAreOneWholeBackward) {
  c10::weak_intrusive_ptr<c10::StorageImpl> tanh_output{c10::intrusive_ptr<c10::StorageImpl>()};
  auto make = [&] {
    torch::manual_seed(3);
    torch::nn::Linear frozen(16, 16);
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                 torch::nn::Functional([&](const at::Tensor& t) {
                                   tanh_output = t.storage().getWeakStorageImpl();
                                   return t;
                                 }),
                                 frozen, torch::nn::Dropout(0.25), torch::nn::Linear(16, 16),
                                 torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                 torch::nn::Linear(16, 4));
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto x = at::randn({6, 8}, gen), g = at::randn({6, 4}, gen);
  for (const bool input_grad : {true, false}) {
    SCOPED_TRACE(input_grad ? "the input needs a gradient" : "the input needs none");
    auto whole = make();
    auto xw = x.detach().requires_grad_(input_grad);
    torch::manual_seed(11);  // the dropout's mask
    whole->forward(xw).backward(g);

    auto split_model = make();
    SplitStage split(split_model);
    auto xs = x.detach().requires_grad_(input_grad);
    SplitStage::Graph graph;
    torch::manual_seed(11);
    auto out = split.forward(xs, graph);
    graph.out = out;
    out = at::Tensor();
    const auto gx = split.input_gradient(graph, g);
    if (input_grad) {
      EXPECT_TRUE(testing::bit_for_bit(gx, xw.grad()));
      // The Tanh's output, saved by the Tanh and the frozen Linear, is gone after I.
      EXPECT_TRUE(tanh_output.expired());
    } else {
      EXPECT_FALSE(gx.defined());
    }
    for (const auto& p : split_model->parameters()) {
      if (p.requires_grad()) {
        EXPECT_FALSE(p.grad().defined()) << "W's gradients before W";
      }
    }
    split.weight_gradient(graph);
    EXPECT_TRUE(graph.roots.empty());
    const auto want = whole->parameters(), got = split_model->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      SCOPED_TRACE("parameter " + std::to_string(k));
      if (!want[k].requires_grad()) continue;
      EXPECT_TRUE(testing::bit_for_bit(got[k].grad(), want[k].grad()));
    }
  }
}

// A layer with weights inside and a skip around them (its W part reaches back to the layer
// before through the skip: cut), and two weighted layers with nothing between them.
struct ResidualImpl : torch::nn::Module {
  explicit ResidualImpl(int64_t width)
      : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc->forward(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Residual);

TEST(SplitBackward, ResidualAndAdjacentLayersAreOneWholeBackward) {
  auto make = [] {
    torch::manual_seed(5);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 16), Residual(16),
                                 torch::nn::Tanh(), Residual(16), torch::nn::Linear(16, 4));
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const auto x = at::randn({5, 8}, gen), g = at::randn({5, 4}, gen);
  auto whole = make();
  auto xw = x.detach().requires_grad_(true);
  whole->forward(xw).backward(g);
  for (int step = 0; step < 2; ++step) {  // the second accumulates onto the first
    auto split_model = make();
    if (step == 1) {
      for (auto& p : split_model->parameters()) p.mutable_grad() = at::ones_like(p);
    }
    SplitStage split(split_model);
    SplitStage::Graph graph;
    auto xs = x.detach().requires_grad_(true);
    auto out = split.forward(xs, graph);
    graph.out = out;
    out = at::Tensor();
    EXPECT_TRUE(testing::bit_for_bit(split.input_gradient(graph, g), xw.grad()));
    split.weight_gradient(graph);
    const auto want = whole->parameters(), got = split_model->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      SCOPED_TRACE("parameter " + std::to_string(k));
      const at::Tensor expected = step == 0 ? want[k].grad() : want[k].grad() + 1;
      EXPECT_TRUE(testing::bit_for_bit(got[k].grad(), expected));
    }
  }
}

}  // namespace
}  // namespace scaletrain
