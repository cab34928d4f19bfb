// The pipeline across ranks (threads of this process over loopback Gloo): gradients equal the
// whole model's for 2 and 3 stages, GPipe, 1F1B, zero bubble H1 and interleaved 1F1B (2 ranks of
// 2 chunks), micro-batch counts that do and do not divide the batch; and a data x pipeline grid of
// 4 ranks (2 replicas of 2 stages, DDP across the replicas of each stage) equals the whole model on
// the whole batch. Each against the exact float64 values, with the bound of their arithmetic (Note
// [Tolerances]).

#include "scaletrain/dist_pipeline.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <array>
#include <atomic>
#include <mutex>
#include <utility>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "support/ranks.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

std::mutex model_mutex;  // rank threads share the global generator

// 5 layers; `deep`: 7 (one more Linear(16, 16) and ReLU), for 6 stages of 3 ranks x 2 chunks.
torch::nn::Sequential make_model(bool deep = false) {
  std::lock_guard lock(model_mutex);
  torch::manual_seed(0);
  torch::nn::Sequential s(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                          torch::nn::ReLU());
  if (deep) {
    s->push_back(torch::nn::Linear(16, 16));
    s->push_back(torch::nn::ReLU());
  }
  s->push_back(torch::nn::Linear(16, 4));
  return s;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::mse_loss(out, y);
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return {at::randn({n, 8}, gen), at::randn({n, 4}, gen)};
}

at::Tensor run_sequential(torch::nn::Module& m, const at::Tensor& x) {
  return static_cast<torch::nn::SequentialImpl&>(m).forward(x);
}

// Exact gradients of the whole model on the whole batch, and their magnitudes.
testing::Exact reference(const Batch& b, bool deep = false) {
  return testing::exact_and_magnitudes([deep] { return make_model(deep).ptr(); }, run_sequential,
                                       testing::weights_of(*make_model(deep)), b.x,
                                       testing::mse_gradient(b.y));
}

// The part of `all` (one entry per parameter of the whole model) that layers [begin, end) hold.
testing::Exact slice_of(const testing::Exact& all, size_t begin, size_t end, bool deep = false) {
  auto whole = make_model(deep);
  size_t first = 0;
  for (size_t l = 0; l < begin; ++l) first += whole[l]->parameters().size();
  size_t count = slice(whole, begin, end)->parameters().size();
  testing::Exact part = all;
  part.grads.assign(all.grads.begin() + static_cast<std::ptrdiff_t>(first),
                    all.grads.begin() + static_cast<std::ptrdiff_t>(first + count));
  part.grad_magnitudes.assign(
      all.grad_magnitudes.begin() + static_cast<std::ptrdiff_t>(first),
      all.grad_magnitudes.begin() + static_cast<std::ptrdiff_t>(first + count));
  return part;
}

// Terms along the model's longest chain: forward fan-ins 9, 17, 17 (deep: and 17); the loss 3;
// backward fan-outs 16, 4 (deep: and 16); the batch; micro-batch weights and sums; a DDP
// average over `replicas`.
double terms(int64_t rows, int chunks, int replicas = 1, bool deep = false) {
  return 9 + 17 + 17 + 3 + 16 + 4 + (deep ? 17 + 16 : 0) + static_cast<double>(rows) + 2 * chunks +
         1 + replicas;
}

struct Case {
  std::vector<size_t> cuts;  // layer boundaries: stage k holds [cuts[k], cuts[k+1])
  int chunks;
  PipelineSchedule schedule;
  int per_rank = 1;   // interleaved: stages per rank; stage k on rank k mod p
  bool deep = false;  // make_model(deep)
  PipelineCheckpoint checkpoint = PipelineCheckpoint::kNever;
};

// e.g. "1f1b_3stages_4chunks": the test's name, and its parameter in ctest's list.
std::string describe(const Case& c) {
  static const char* const schedules[] = {"gpipe", "1f1b", "interleaved", "zbh1"};
  return std::string(schedules[static_cast<int>(c.schedule)]) + "_" +
         std::to_string(c.cuts.size() - 1) + "stages_" + std::to_string(c.chunks) + "chunks" +
         (c.deep ? "_deep" : "") +
         (c.checkpoint == PipelineCheckpoint::kAlways       ? "_recomputed"
          : c.checkpoint == PipelineCheckpoint::kExceptLast ? "_recomputedbutlast"
                                                            : "");
}
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }
std::string case_name(const ::testing::TestParamInfo<Case>& i) { return describe(i.param); }

class DistPipelineTransparency : public ::testing::TestWithParam<Case> {};

TEST_P(DistPipelineTransparency, GradientsEqualTheWholeModel) {
  const Case c = GetParam();
  const int stages = static_cast<int>(c.cuts.size()) - 1, p = stages / c.per_rank;
  const Batch b = batch(10);
  // Through shared-memory links, then through Gloo (Note [Point-to-point paths]).
  for (const bool shared_memory : {true, false}) {
    SCOPED_TRACE(shared_memory ? "shared memory" : "gloo");
    std::vector<std::vector<at::Tensor>> got(static_cast<size_t>(stages));
    double loss = 0;
    auto errors = testing::run_ranks(p, [&](Dist& d) {
      DistPipelineOptions o;
      for (int r = 0; r < p; ++r) o.stage_ranks.push_back(r);
      o.chunks = c.chunks;
      o.schedule = c.schedule;
      o.shared_memory = shared_memory;
      o.checkpoint = c.checkpoint;
      std::vector<torch::nn::Sequential> mine;  // stages rank, rank + p, ...
      for (int k = d.rank(); k < stages; k += p) {
        mine.push_back(slice(make_model(c.deep), c.cuts[static_cast<size_t>(k)],
                             c.cuts[static_cast<size_t>(k) + 1]));
      }
      auto pipe = c.per_rank > 1 ? DistPipeline(mine, o, d) : DistPipeline(mine[0], o, d);
      auto l = pipe.train_step(d.rank() == 0 ? b.x : at::Tensor(),
                               d.rank() == p - 1 ? b.y : at::Tensor(), mse);
      if (l.defined()) loss = l.item<double>();
      EXPECT_EQ(pipe.transport(), shared_memory ? "shared memory" : "gloo");
      for (int chunk = 0; chunk < c.per_rank; ++chunk) {
        for (auto& param : pipe.chunk(chunk)->parameters()) {
          got[static_cast<size_t>(chunk * p + d.rank())].push_back(param.grad());
        }
      }
    });
    ASSERT_EQ(errors, std::vector<std::string>(static_cast<size_t>(p)));
    const auto exact = reference(b, c.deep);
    const double k = terms(10, c.chunks, 1, c.deep);
    auto value = testing::mse_value(exact, b.y);
    EXPECT_TRUE(testing::within_rounding(at::scalar_tensor(loss), value.exact, value.magnitude, k));
    for (int s = 0; s < stages; ++s) {
      const auto us = static_cast<size_t>(s);
      testing::expect_gradients_within_rounding(got[us],
                                                slice_of(exact, c.cuts[us], c.cuts[us + 1], c.deep),
                                                k, "stage " + std::to_string(s));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DistPipelineTransparency,
    ::testing::Values(
        Case{{0, 2, 5}, 1, PipelineSchedule::kGPipe}, Case{{0, 2, 5}, 4, PipelineSchedule::kGPipe},
        Case{{0, 3, 5}, 3, PipelineSchedule::k1F1B},
        Case{{0, 1, 3, 5}, 5, PipelineSchedule::kGPipe},
        Case{{0, 1, 3, 5}, 4, PipelineSchedule::k1F1B},
        Case{{0, 2, 5}, 4, PipelineSchedule::kZeroBubbleH1},
        Case{{0, 1, 3, 5}, 5, PipelineSchedule::kZeroBubbleH1},
        // 2 ranks x 2 chunks; 3 and 1 micro-batches: not whole
        // rounds of 2, fill-drain over the chunks
        Case{{0, 1, 2, 3, 5}, 4, PipelineSchedule::kInterleaved1F1B, 2},
        Case{{0, 1, 2, 3, 5}, 8, PipelineSchedule::kInterleaved1F1B, 2},
        Case{{0, 1, 2, 3, 5}, 3, PipelineSchedule::kInterleaved1F1B, 2},
        Case{{0, 1, 2, 3, 5}, 1, PipelineSchedule::kInterleaved1F1B, 2},
        // 3 ranks x 2 chunks: the ring's two directions differ
        Case{{0, 1, 2, 3, 4, 5, 7}, 6, PipelineSchedule::kInterleaved1F1B, 2, true},
        Case{{0, 1, 2, 3, 4, 5, 7}, 4, PipelineSchedule::kInterleaved1F1B, 2, true},
        // Activation checkpointing: forwards keep their inputs only and run
        // again in backward (I under zero bubble), whatever the schedule
        Case{{0, 2, 5}, 4, PipelineSchedule::kGPipe, 1, false, PipelineCheckpoint::kAlways},
        Case{{0, 1, 3, 5}, 4, PipelineSchedule::k1F1B, 1, false, PipelineCheckpoint::kExceptLast},
        Case{{0, 2, 5}, 4, PipelineSchedule::kZeroBubbleH1, 1, false, PipelineCheckpoint::kAlways},
        Case{{0, 1, 2, 3, 5},
             4,
             PipelineSchedule::kInterleaved1F1B,
             2,
             false,
             PipelineCheckpoint::kAlways}),
    case_name);

// Activation checkpointing across ranks is done, not only equal: a checkpointed micro-batch's
// forward runs again in its backward (GPipe, 4 micro-batches: 4 forwards, 7 when all but the
// last are checkpointed, 8 when all are).
TEST(DistPipeline, CheckpointedMicroBatchesRunTheirForwardAgainInBackward) {
  const Batch b = batch(8);
  for (const auto& [policy, runs] :
       {std::pair{PipelineCheckpoint::kNever, 4}, std::pair{PipelineCheckpoint::kExceptLast, 7},
        std::pair{PipelineCheckpoint::kAlways, 8}}) {
    std::array<std::atomic<int>, 2> forwards{};
    auto errors = testing::run_ranks(2, [&, policy = policy](Dist& d) {
      DistPipelineOptions o;
      o.stage_ranks = {0, 1};
      o.chunks = 4;
      o.checkpoint = policy;
      const auto r = static_cast<size_t>(d.rank());
      auto stage = r == 0 ? slice(make_model(), 0, 2) : slice(make_model(), 2, 5);
      auto& count = forwards[r];
      stage->push_back("count", torch::nn::Functional([&count](const at::Tensor& x) {
                         ++count;
                         return x;
                       }));
      DistPipeline pipe(stage, o, d);
      pipe.train_step(r == 0 ? b.x : at::Tensor(), r == 1 ? b.y : at::Tensor(), mse);
    });
    ASSERT_EQ(errors, std::vector<std::string>(2));
    EXPECT_EQ(forwards[0].load(), runs) << static_cast<int>(policy);
    EXPECT_EQ(forwards[1].load(), runs) << static_cast<int>(policy);
  }
}

// Interleaved forward (no grad) chunk by chunk across 2 ranks: the whole model's output.
TEST(DistPipeline, InterleavedForwardEqualsTheWholeModel) {
  const Batch b = batch(6);
  const std::vector<size_t> cuts = {0, 1, 2, 3, 5};
  at::Tensor out;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    DistPipelineOptions o;
    o.stage_ranks = {0, 1};
    o.chunks = 3;
    o.schedule = PipelineSchedule::kInterleaved1F1B;
    const auto r = static_cast<size_t>(d.rank());
    DistPipeline pipe(
        {slice(make_model(), cuts[r], cuts[r + 1]), slice(make_model(), cuts[r + 2], cuts[r + 3])},
        o, d);
    auto y = pipe.forward(d.rank() == 0 ? b.x : at::Tensor());
    if (d.rank() == 1) out = y;
  });
  ASSERT_EQ(errors, std::vector<std::string>(2));
  const auto exact = reference(b);
  EXPECT_TRUE(testing::within_rounding(out, exact.output, exact.output_magnitude, terms(6, 3)));
}

// 4 ranks: rank = replica * 2 + stage. Replica r trains on half r of the batch; DDP averages
// each stage's gradients over the two replicas: the whole model on the whole batch.
TEST(DistPipeline, DataTimesPipelineGridOnFourRanks) {
  const Batch b = batch(12);
  const std::vector<size_t> cuts = {0, 2, 5};
  std::vector<std::vector<at::Tensor>> got(4);
  auto errors = testing::run_ranks(4, [&](Dist& d) {
    const int replica = d.rank() / 2, stage = d.rank() % 2;
    auto group = new_group(d, {stage, stage + 2}, "stage" + std::to_string(stage));
    ASSERT_TRUE(group.has_value());
    auto module =
        slice(make_model(), cuts[static_cast<size_t>(stage)], cuts[static_cast<size_t>(stage) + 1]);
    DistributedDataParallel ddp(module.ptr(), *group);
    DistPipelineOptions o;
    o.stage_ranks = {2 * replica, 2 * replica + 1};
    o.chunks = 3;
    o.schedule = PipelineSchedule::k1F1B;
    o.ddp = &ddp;
    DistPipeline pipe(module, o, d);
    auto half = [&](const at::Tensor& t) { return t.narrow(0, 6 * replica, 6); };
    pipe.train_step(stage == 0 ? half(b.x) : at::Tensor(), stage == 1 ? half(b.y) : at::Tensor(),
                    mse);
    for (auto& param : module->parameters())
      got[static_cast<size_t>(d.rank())].push_back(param.grad().clone());
  });
  ASSERT_EQ(errors, std::vector<std::string>(4));
  const auto exact = reference(b);
  for (int rank = 0; rank < 4; ++rank) {
    const auto stage = static_cast<size_t>(rank % 2);
    testing::expect_gradients_within_rounding(got[static_cast<size_t>(rank)],
                                              slice_of(exact, cuts[stage], cuts[stage + 1]),
                                              terms(12, 3, 2), "rank " + std::to_string(rank));
  }
}

// A batch of fewer samples than `chunks` (an epoch's last) runs as fewer micro-batches on every
// stage, and the forward alone (evaluation) gives the whole model's outputs on the last stage.
TEST(DistPipeline, SmallBatchesAndForwardAcrossRanks) {
  const Batch b = batch(3);  // chunks 5
  std::vector<std::vector<at::Tensor>> got(2);
  at::Tensor out;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    const auto s = static_cast<size_t>(d.rank());
    DistPipelineOptions o;
    o.stage_ranks = {0, 1};
    o.chunks = 5;
    o.schedule = PipelineSchedule::k1F1B;
    const std::vector<size_t> cuts = {0, 2, 5};
    DistPipeline pipe(slice(make_model(), cuts[s], cuts[s + 1]), o, d);
    pipe.train_step(s == 0 ? b.x : at::Tensor(), s == 1 ? b.y : at::Tensor(), mse);
    for (auto& param : pipe.module()->parameters()) got[s].push_back(param.grad());
    auto y = pipe.forward(s == 0 ? b.x : at::Tensor());
    EXPECT_EQ(y.defined(), s == 1);
    if (s == 1) out = y;
  });
  ASSERT_EQ(errors, std::vector<std::string>(2));
  const auto exact = reference(b);
  const double k = terms(3, 3);
  testing::expect_gradients_within_rounding(got[0], slice_of(exact, 0, 2), k, "stage 0");
  testing::expect_gradients_within_rounding(got[1], slice_of(exact, 2, 5), k, "stage 1");
  EXPECT_TRUE(testing::within_rounding(out, exact.output, exact.output_magnitude, k));
}

// Note [Shapes once]: the first step sends each activation's shape, later steps of the same
// batch shape receive into buffers posted ahead without them (two such steps in a row), a short
// batch sends them again and so does the full batch after it, and every step's gradients are
// the whole model's on that step's batch. 1F1B over 3 ranks mixes activations and gradients in
// the middle rank's posted receives.
TEST(DistPipeline, LaterStepsReuseShapesAndAShortBatchSendsThemAgain) {
  const Batch b = batch(10);
  struct Sched {
    PipelineSchedule schedule;
    std::vector<size_t> cuts;
    int per_rank;
  };
  for (const auto& sc : {Sched{PipelineSchedule::k1F1B, {0, 2, 5}, 1},
                         Sched{PipelineSchedule::k1F1B, {0, 1, 3, 5}, 1},
                         Sched{PipelineSchedule::kZeroBubbleH1, {0, 2, 5}, 1},
                         Sched{PipelineSchedule::kInterleaved1F1B, {0, 1, 2, 3, 5}, 2}}) {
    const int stages = static_cast<int>(sc.cuts.size()) - 1, p = stages / sc.per_rank;
    const std::vector<int64_t> sizes = {10, 10, 10, 7, 10};       // rows per step
    const std::vector<int64_t> shapes_sent_at = {1, 1, 1, 2, 3};  // steps that sent shapes
    std::vector<std::vector<std::vector<at::Tensor>>> got(
        sizes.size(), std::vector<std::vector<at::Tensor>>(static_cast<size_t>(stages)));
    auto errors = testing::run_ranks(p, [&](Dist& d) {
      DistPipelineOptions o;
      for (int r = 0; r < p; ++r) o.stage_ranks.push_back(r);
      o.chunks = 4;
      o.schedule = sc.schedule;
      std::vector<torch::nn::Sequential> mine;
      for (int k = d.rank(); k < stages; k += p) {
        mine.push_back(slice(make_model(), sc.cuts[static_cast<size_t>(k)],
                             sc.cuts[static_cast<size_t>(k) + 1]));
      }
      auto pipe = sc.per_rank > 1 ? DistPipeline(mine, o, d) : DistPipeline(mine[0], o, d);
      int64_t per_step = 0;  // shape messages of a step that sends them
      for (size_t step = 0; step < sizes.size(); ++step) {
        for (auto& c : mine) c->zero_grad();
        const auto x = b.x.narrow(0, 0, sizes[step]), y = b.y.narrow(0, 0, sizes[step]);
        pipe.train_step(d.rank() == 0 ? x : at::Tensor(), d.rank() == p - 1 ? y : at::Tensor(),
                        mse);
        if (step == 0) per_step = pipe.shape_messages();
        EXPECT_EQ(pipe.shape_messages(), shapes_sent_at[step] * per_step)
            << "rank " << d.rank() << ", step " << step;
        for (int chunk = 0; chunk < sc.per_rank; ++chunk) {
          for (auto& param : pipe.chunk(chunk)->parameters()) {
            got[step][static_cast<size_t>(chunk * p + d.rank())].push_back(param.grad().clone());
          }
        }
      }
      if (d.rank() == 0) {
        EXPECT_GT(per_step, 0);
      }
    });
    ASSERT_EQ(errors, std::vector<std::string>(static_cast<size_t>(p)));
    for (size_t step = 0; step < sizes.size(); ++step) {
      const Batch part{b.x.narrow(0, 0, sizes[step]), b.y.narrow(0, 0, sizes[step])};
      const auto exact = reference(part);
      for (int s = 0; s < stages; ++s) {
        const auto us = static_cast<size_t>(s);
        testing::expect_gradients_within_rounding(
            got[step][us], slice_of(exact, sc.cuts[us], sc.cuts[us + 1]), terms(sizes[step], 4),
            "step " + std::to_string(step) + ", stage " + std::to_string(s));
      }
    }
  }
}

// Regression (one-sided failure): the first rank fails in its last backward of a step, after
// the last rank finished the step; the next step must not have one rank skip the shapes while
// the other sends them (every rank agrees on reuse), and trains as if nothing happened.
TEST(DistPipeline, AStepAfterOneRankFailedAloneStillAgreesOnShapes) {
  const Batch b = batch(8);
  std::vector<std::vector<at::Tensor>> got(2);
  auto errors = testing::run_ranks(
      2,
      [&](Dist& d) {
        DistPipelineOptions o;
        o.stage_ranks = {0, 1};
        o.chunks = 4;
        o.schedule = PipelineSchedule::k1F1B;
        auto module = slice(make_model(), d.rank() == 0 ? 0 : 2, d.rank() == 0 ? 2 : 5);
        int calls = 0;  // backwards through the first layer: 4 per step
        if (d.rank() == 0) {
          module->parameters()[0].register_hook([&calls](const at::Tensor& g) {
            if (++calls == 8) throw std::runtime_error("injected failure");
            return g;
          });
        }
        DistPipeline pipe(module, o, d);
        bool failed = false;
        for (int step = 0; step < 3; ++step) {
          module->zero_grad();
          try {
            pipe.train_step(d.rank() == 0 ? b.x : at::Tensor(), d.rank() == 1 ? b.y : at::Tensor(),
                            mse);
          } catch (const std::exception& e) {
            EXPECT_EQ(d.rank(), 0) << e.what();
            EXPECT_EQ(step, 1) << e.what();
            failed = true;
          }
        }
        EXPECT_EQ(failed, d.rank() == 0) << "rank " << d.rank() << ": the injected failure";
        for (auto& param : module->parameters())
          got[static_cast<size_t>(d.rank())].push_back(param.grad());
      },
      std::chrono::seconds(10));
  ASSERT_EQ(errors, std::vector<std::string>(2));
  const auto exact = reference(b);
  testing::expect_gradients_within_rounding(got[0], slice_of(exact, 0, 2), terms(8, 4), "stage 0");
  testing::expect_gradients_within_rounding(got[1], slice_of(exact, 2, 5), terms(8, 4), "stage 1");
}

// A stage whose output shape changes while the batch's does not is an error on the rank that
// sends it, never a receive of the wrong size.
TEST(DistPipeline, AnOutputShapeThatChangesAloneIsAnError) {
  const Batch b = batch(8);
  auto errors = testing::run_ranks(
      2,
      [&](Dist& d) {
        DistPipelineOptions o;
        o.stage_ranks = {0, 1};
        o.chunks = 2;
        o.schedule = PipelineSchedule::k1F1B;
        int calls = 0;
        torch::nn::Sequential first(torch::nn::Linear(8, 16),
                                    torch::nn::Functional([&calls](const at::Tensor& x) {
                                      return ++calls > 2 ? x.narrow(1, 0, 8) : x;
                                    }));
        DistPipeline pipe(d.rank() == 0 ? first : slice(make_model(), 2, 5), o, d);
        for (int step = 0; step < 2; ++step) {
          pipe.train_step(d.rank() == 0 ? b.x : at::Tensor(), d.rank() == 1 ? b.y : at::Tensor(),
                          mse);
        }
      },
      std::chrono::seconds(5));
  EXPECT_NE(errors[0].find("another shape than at the last step of the same batch shape"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1], "");  // it waited for the activation and timed out, naming it
}

// Regression (channels-last boundary): a stage whose output is a channels-last convolution
// activation received its gradient into a buffer of the same memory format, which Gloo refuses
// ("input tensor has to be contiguous"); the gradients must be the whole model's.
TEST(DistPipeline, ChannelsLastActivationAtTheBoundary) {
  auto make = [] {
    std::lock_guard lock(model_mutex);
    torch::manual_seed(0);
    torch::nn::Sequential s(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3)),
                            torch::nn::Flatten(), torch::nn::Linear(3 * 4 * 4, 2));
    auto& w = s[0]->as<torch::nn::Conv2d>()->weight;
    w.set_data(w.contiguous(at::MemoryFormat::ChannelsLast));
    return s;
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto x = at::randn({4, 2, 6, 6}, gen).contiguous(at::MemoryFormat::ChannelsLast);
  const auto y = at::randn({4, 2}, gen);
  const auto exact =
      testing::exact_and_magnitudes([&] { return make().ptr(); }, run_sequential,
                                    testing::weights_of(*make()), x, testing::mse_gradient(y));
  // Fan-ins 18 + 1 and 48 + 1, the loss 3, fan-outs 2 and 3, the batch 4, two micro-batches.
  const double k = 19 + 49 + 3 + 5 + 4 + 2 * 2 + 1;
  for (auto schedule : {PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubbleH1}) {
    std::vector<std::vector<at::Tensor>> got(2);
    auto errors = testing::run_ranks(2, [&](Dist& d) {
      DistPipelineOptions o;
      o.stage_ranks = {0, 1};
      o.chunks = 2;
      o.schedule = schedule;
      DistPipeline pipe(d.rank() == 0 ? slice(make(), 0, 1) : slice(make(), 1, 3), o, d);
      pipe.train_step(d.rank() == 0 ? x : at::Tensor(), d.rank() == 1 ? y : at::Tensor(), mse);
      for (auto& p : pipe.module()->parameters()) {
        got[static_cast<size_t>(d.rank())].push_back(p.grad());
      }
    });
    ASSERT_EQ(errors, std::vector<std::string>(2));
    testing::Exact first = exact, second = exact;
    first.grads.resize(2);
    first.grad_magnitudes.resize(2);
    second.grads.erase(second.grads.begin(), second.grads.begin() + 2);
    second.grad_magnitudes.erase(second.grad_magnitudes.begin(),
                                 second.grad_magnitudes.begin() + 2);
    testing::expect_gradients_within_rounding(got[0], first, k, "stage 0");
    testing::expect_gradients_within_rounding(got[1], second, k, "stage 1");
  }
}

TEST(DistPipeline, BadOptionsAreRefused) {
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    DistPipelineOptions o;
    o.stage_ranks = {1, 2};
    EXPECT_THROW(DistPipeline(make_model(), o, d), UsageError);
    o.stage_ranks = {0};
    o.chunks = 4;
    o.schedule = PipelineSchedule::kInterleaved1F1B;  // needs 2 chunks per rank
    EXPECT_THROW(DistPipeline(make_model(), o, d), UsageError);
    EXPECT_THROW(DistPipeline({make_model(), make_model()}, o, d), UsageError);  // and 2 ranks
    o.schedule = PipelineSchedule::k1F1B;  // 2 chunks are interleaving
    EXPECT_THROW(DistPipeline({make_model(), make_model()}, o, d), UsageError);
    auto module = make_model();
    DistributedDataParallel ddp(module.ptr(), d);
    o.schedule = PipelineSchedule::kZeroBubbleH1;  // not with a grid's DDP
    o.ddp = &ddp;
    EXPECT_THROW(DistPipeline(module, o, d), UsageError);
    o.ddp = nullptr;
    o.schedule = PipelineSchedule::k1F1B;
    DistPipeline pipe(make_model(), o, d);
    EXPECT_THROW(pipe.train_step(at::Tensor(), at::randn({2, 4}), mse), UsageError);
    EXPECT_THROW(new_group(d, {0, 0}, "twice"), UsageError);
  });
  EXPECT_EQ(errors, std::vector<std::string>{""});
}

}  // namespace
}  // namespace scaletrain
