// DDP transparency: at every one of K steps of DDP over N ranks with per-rank batch B, the
// averaged gradient on every rank is the gradient of single-process training with batch N*B over
// the same samples, at the weights the rank holds (Note [Tolerances]: each checked against the
// exact float64 gradient, with the bound of its arithmetic), and every rank holds the same
// weights, bit for bit, after the optimizer steps.

#include "scaletrain/ddp.h"

#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <mutex>

#include "scaletrain/error.h"
#include "support/ranks.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

using testing::run_ranks;
namespace F = torch::nn::functional;

constexpr int64_t kIn = 8, kHidden = 16, kOut = 4, kPerRank = 3, kSteps = 4;

// A module with a head that forward never uses when `use_head2` is false.
struct TwoHeads : torch::nn::Module {
  TwoHeads() {
    body = register_module("body", torch::nn::Linear(kIn, kHidden));
    head1 = register_module("head1", torch::nn::Linear(kHidden, kOut));
    head2 = register_module("head2", torch::nn::Linear(kHidden, kOut));
  }
  at::Tensor forward(const at::Tensor& x, bool use_head2 = false) {
    auto h = torch::relu(body->forward(x));
    return use_head2 ? head1->forward(h) + head2->forward(h) : head1->forward(h);
  }
  torch::nn::Linear body{nullptr}, head1{nullptr}, head2{nullptr};
};

std::shared_ptr<TwoHeads> make_model(int perturb) {
  // Ranks are threads sharing the global generator: seed and draw under one lock, or ranks'
  // draws interleave and rank 0's model differs from the single-process reference.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(0);
  auto m = std::make_shared<TwoHeads>();
  if (perturb != 0) {
    torch::NoGradGuard g;
    for (auto& p : m->parameters()) p.add_(0.1 * perturb);  // DDP must broadcast rank 0's
  }
  return m;
}

struct Data {
  at::Tensor x, y;
};

Data make_data(int world, int accumulate) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  const int64_t n = world * kPerRank * kSteps * accumulate;
  return {at::randn({n, kIn}, gen), at::randn({n, kOut}, gen)};
}

// Rows of step s (micro-step a of `accumulate`) for rank r, or for all ranks when r < 0.
at::Tensor rows(const at::Tensor& t, int world, int accumulate, int s, int a, int r) {
  const int64_t global = world * kPerRank;
  const int64_t start = (static_cast<int64_t>(s) * accumulate + a) * global;
  if (r < 0) return t.narrow(0, start, global);
  return t.narrow(0, start + r * kPerRank, kPerRank);
}

// All rows of step s, every micro-step and every rank.
at::Tensor step_rows(const at::Tensor& t, int world, int accumulate, int s) {
  const int64_t n = world * kPerRank * accumulate;
  return t.narrow(0, s * n, n);
}

struct Case {
  int accumulate = 1;
  DDPOptions options;
};

// Terms along the longest chain of TwoHeads' gradient (Note [Tolerances]): forward fan-ins
// (body 8+1, each head 16+1, their sum 1), the loss (3), the backward's fan-out into the body
// (two heads of 4, and their sum), the batch reduction of the body's weight gradient over every
// row of the step, and DDP's division by the world and sum over the ranks.
double terms(int world, const Case& c) {
  const double rows = static_cast<double>(world * kPerRank * c.accumulate);
  return (9 + 17 + 17 + 1) + 3 + (4 + 4 + 1) + rows + (1 + world);
}

// Trains with DDP on every rank for kSteps steps; at each step every rank's averaged gradients
// are checked against the exact gradient of the whole step's batch at the rank's weights (with
// `wire` the dtype of a compression hook), and after the last step every rank's weights are
// compared with rank 0's bit for bit.
void expect_transparent(int world, const Case& c, at::ScalarType wire = at::kFloat) {
  const double lr = 0.1;
  double k = terms(world, c);
  double floor = 0;
  if (wire != at::kFloat) {
    // Each rank's share is rounded to the wire's type, then the world's shares are summed there.
    k = testing::with_narrow_terms(k, world, wire);
    if (wire == at::kHalf) floor = world * std::ldexp(1.0, -25);  // fp16's subnormal spacing
  }
  std::vector<std::vector<at::Tensor>> final_weights(static_cast<size_t>(world));
  auto errors = run_ranks(world, [&](Dist& d) {
    auto model = make_model(d.rank());
    auto data = make_data(world, c.accumulate);
    DistributedDataParallel ddp(model, d, c.options);
    // Threads of one process share /dev/shm: the fast path is taken whenever it is asked for.
    EXPECT_EQ(ddp.uses_shared_memory(), world > 1 && c.options.shared_memory);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      const auto weights = testing::weights_of(*model);
      for (int a = 0; a < c.accumulate; ++a) {
        auto x = rows(data.x, world, c.accumulate, s, a, d.rank());
        auto y = rows(data.y, world, c.accumulate, s, a, d.rank());
        auto step = [&] {
          auto out = ddp.forward([&] { return model->forward(x); });
          F::mse_loss(out, y).backward();
        };
        if (a + 1 < c.accumulate) {
          auto guard = ddp.no_sync();
          step();
        } else {
          step();
        }
      }
      std::vector<at::Tensor> grads;
      for (auto& p : model->parameters()) grads.push_back(p.grad());
      // The single-process loss sums `accumulate` micro-batch means over the whole step.
      auto exact = testing::exact_and_magnitudes(
          [] { return make_model(0); },
          [](torch::nn::Module& m, const at::Tensor& x) {
            return static_cast<TwoHeads&>(m).forward(x);
          },
          weights, step_rows(data.x, world, c.accumulate, s),
          testing::mse_gradient(step_rows(data.y, world, c.accumulate, s), c.accumulate));
      testing::expect_gradients_within_rounding(
          grads, exact, k, "rank " + std::to_string(d.rank()) + ", step " + std::to_string(s),
          at::kFloat, floor);
      opt.step();
    }
    final_weights[static_cast<size_t>(d.rank())] = testing::weights_of(*model);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 1; r < world; ++r) {
    for (size_t i = 0; i < final_weights[0].size(); ++i) {
      EXPECT_TRUE(at::equal(final_weights[static_cast<size_t>(r)][i], final_weights[0][i]))
          << "rank " << r << " parameter " << i << " drifted from rank 0's";
    }
  }
}

class DDPWorlds : public ::testing::TestWithParam<int> {};

TEST_P(DDPWorlds, EqualsSingleProcessTraining) {
  Case c;
  c.options.find_unused_parameters = true;  // head2 is never used
  expect_transparent(GetParam(), c);
}

TEST_P(DDPWorlds, EqualsSingleProcessWithTinyBucketsAndNoOverlap) {
  Case c;
  c.options.find_unused_parameters = true;
  c.options.first_bucket_cap_mb = 1e-4;  // ~100 bytes: one bucket per parameter or two
  c.options.bucket_cap_mb = 3e-4;
  expect_transparent(GetParam(), c);
  c.options.overlap = false;
  expect_transparent(GetParam(), c);
}

// The same through Gloo alone (as between machines): shared memory off.
TEST_P(DDPWorlds, EqualsSingleProcessOverGlooAlone) {
  Case c;
  c.options.find_unused_parameters = true;
  c.options.shared_memory = false;
  c.options.first_bucket_cap_mb = 1e-4;
  expect_transparent(GetParam(), c);
}

INSTANTIATE_TEST_SUITE_P(Sizes, DDPWorlds, ::testing::Values(1, 2, 3, 4));

// Two ranks: a + b is b + a, so shared memory and Gloo agree to the bit.
TEST(DDP, SharedMemoryAndGlooGiveTheSameBits) {
  std::vector<std::vector<at::Tensor>> grads(2);
  for (bool shm : {true, false}) {
    auto errors = run_ranks(2, [&](Dist& d) {
      auto model = make_model(0);
      DDPOptions o;
      o.find_unused_parameters = true;
      o.shared_memory = shm;
      o.first_bucket_cap_mb = 1e-4;  // several buckets
      DistributedDataParallel ddp(model, d, o);
      auto x = at::randn({4, kIn}, at::make_generator<at::CPUGeneratorImpl>(d.rank()));
      ddp.forward([&] { return model->forward(x); }).pow(2).sum().backward();
      if (d.rank() == 1) {
        for (auto& p : model->parameters())
          grads[shm ? 0 : 1].push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
      }
    });
    ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_EQ(grads[0][i].defined(), grads[1][i].defined());
    if (grads[0][i].defined()) {
      EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << i;
    }
  }
}

TEST(DDP, GradientAccumulationWithNoSync) {
  Case c;
  c.accumulate = 3;
  c.options.find_unused_parameters = true;
  expect_transparent(2, c);
}

TEST(DDP, WithoutGradientViews) {
  Case c;
  c.options.find_unused_parameters = true;
  c.options.gradient_as_bucket_view = false;
  expect_transparent(3, c);
}

// Compression hooks: each rank's averaged share is rounded to fp16 (11 significant bits) or
// bf16 (8) for the wire, and the shares are summed there; the bound adds those roundings.
TEST(DDP, Fp16CompressionWithinItsPrecision) {
  Case c;
  c.options.find_unused_parameters = true;
  c.options.comm_hook = CommHook::kFp16;
  expect_transparent(2, c, at::kHalf);
}

TEST(DDP, Bf16CompressionWithinItsPrecision) {
  Case c;
  c.options.find_unused_parameters = true;
  c.options.comm_hook = CommHook::kBf16;
  expect_transparent(2, c, at::kBFloat16);
}

// UnevenInputs::kJoin (PyTorch's Join): ranks 0, 1, 2 have 2, 4 and 3 batches. At each step the
// ranks that still step get the exact gradient over their rows, times A/N (A ranks stepping, N in
// the world) when dividing by the initial world size, else the mean over their rows; the joined
// ranks shadow the all-reduces; after join() every rank holds the last rank's weights, bit for
// bit. Through shared memory and through Gloo alone, with the used-parameter map shadowed too.
TEST(DDPJoin, UnevenRanksFinishTheirStepsAndEndEqual) {
  const std::vector<int> steps = {2, 4, 3};
  const int world = 3;
  for (bool shm : {true, false}) {
    for (bool initial : {true, false}) {
      const std::string what = std::string(shm ? "shared memory" : "Gloo") +
                               (initial ? ", / initial world" : ", / ranks stepping");
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
      auto x = at::randn({4, world, kPerRank, kIn}, gen),
           y = at::randn({4, world, kPerRank, kOut}, gen);
      std::vector<std::vector<at::Tensor>> final_weights(world);
      auto errors = run_ranks(world, [&](Dist& d) {
        auto model = make_model(0);
        DDPOptions o;
        o.find_unused_parameters = true;
        o.shared_memory = shm;
        o.uneven_inputs = UnevenInputs::kJoin;
        o.divide_by_initial_world_size = initial;
        DistributedDataParallel ddp(model, d, o);
        torch::optim::SGD opt(model->parameters(), 0.1);
        for (int s = 0; s < steps[static_cast<size_t>(d.rank())]; ++s) {
          std::vector<at::Tensor> xs, ys;
          for (int r = 0; r < world; ++r) {
            if (steps[static_cast<size_t>(r)] > s) xs.push_back(x[s][r]), ys.push_back(y[s][r]);
          }
          const auto active = static_cast<double>(xs.size());
          auto exact = testing::exact_and_magnitudes(
              [] { return make_model(0); },
              [](torch::nn::Module& m, const at::Tensor& in) {
                return static_cast<TwoHeads&>(m).forward(in);
              },
              testing::weights_of(*model), at::cat(xs),
              testing::mse_gradient(at::cat(ys), initial ? active / world : 1));
          opt.zero_grad();
          auto out = ddp.forward([&] { return model->forward(x[s][d.rank()]); });
          F::mse_loss(out, y[s][d.rank()]).backward();
          std::vector<at::Tensor> grads;
          for (auto& p : model->parameters()) grads.push_back(p.grad());
          testing::expect_gradients_within_rounding(
              grads, exact, terms(static_cast<int>(active), Case{}) + 2,
              what + ", rank " + std::to_string(d.rank()) + ", step " + std::to_string(s));
          opt.step();
        }
        ddp.join();
        final_weights[static_cast<size_t>(d.rank())] = testing::weights_of(*model);
      });
      ASSERT_EQ(errors, std::vector<std::string>(world, "")) << what;
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < final_weights[1].size(); ++i) {
          EXPECT_TRUE(at::equal(final_weights[static_cast<size_t>(r)][i], final_weights[1][i]))
              << what << ": rank " << r << " parameter " << i << " differs from rank 1's";
        }
      }
    }
  }
}

TEST(DDPJoin, ReplicaChecksAndJoinDoNotMix) {
  auto errors = run_ranks(1, [&](Dist& d) {
    DDPOptions o;
    o.uneven_inputs = UnevenInputs::kJoin;
    o.check_replicas_every = 10;
    DistributedDataParallel ddp(make_model(0), d, o);
  });
  EXPECT_NE(errors[0].find("check_replicas_every"), std::string::npos) << errors[0];
}

// Issue: a forward that did not go through DDP fired hooks that skipped the all-reduce, and the
// replicas diverged with no error. Now that backward throws, on every rank, naming the fix.
TEST(DDPContract, CallingTheModuleDirectlyThenBackwardThrowsNamingTheFix) {
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, d, o);
    model->forward(at::ones({2, kIn})).sum().backward();  // not through DDP
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("was computed in a backward that no DDP step started"), std::string::npos)
        << e;
    EXPECT_NE(e.find("ddp.prepare_for_backward(outputs)"), std::string::npos) << e;
  }
  // Inside no_sync() the same backward is a local accumulation, and allowed.
  errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DistributedDataParallel ddp(model, d);
    auto local = ddp.no_sync();
    model->forward(at::ones({2, kIn})).sum().backward();
    EXPECT_TRUE(model->body->weight.grad().defined());
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
}

// DDP is called like the module (ddp(x), for a module type with forward(Tensor)), and outputs of
// a forward run elsewhere become a DDP step with prepare_for_backward: both average, as the
// module called through forward(fn) does, bit for bit.
TEST(DDPContract, CalledLikeTheModuleOrPreparedForBackward) {
  std::vector<std::vector<at::Tensor>> grads(3);
  for (int way = 0; way < 3; ++way) {
    auto errors = run_ranks(2, [&](Dist& d) {
      auto model = make_model(0);
      DDPOptions o;
      o.find_unused_parameters = true;
      DistributedDataParallel ddp(model, d, o);
      auto x = at::randn({3, kIn}, at::make_generator<at::CPUGeneratorImpl>(d.rank()));
      at::Tensor out;
      if (way == 0) {
        out = ddp.forward([&] { return model->forward(x); });
      } else if (way == 1) {
        out = ddp(x);
      } else {
        out = model->forward(x);
        ddp.prepare_for_backward({out});
      }
      out.pow(2).sum().backward();
      if (d.rank() == 0) {
        for (auto& p : model->parameters()) {
          grads[static_cast<size_t>(way)].push_back(p.grad().defined() ? p.grad().clone()
                                                                       : at::Tensor());
        }
      }
    });
    ASSERT_EQ(errors, (std::vector<std::string>{"", ""})) << way;
  }
  for (int way = 1; way < 3; ++way) {
    for (size_t i = 0; i < grads[0].size(); ++i) {
      ASSERT_EQ(grads[0][i].defined(), grads[static_cast<size_t>(way)][i].defined());
      if (grads[0][i].defined()) {
        EXPECT_TRUE(at::equal(grads[0][i], grads[static_cast<size_t>(way)][i])) << way << " " << i;
      }
    }
  }
  // A module holder works the same; a plain Module cannot be called and says how to.
  auto errors = run_ranks(1, [&](Dist& d) {
    torch::nn::Sequential seq(torch::nn::Linear(kIn, kOut));
    DistributedDataParallel holder(seq, d);
    EXPECT_EQ(holder(at::ones({2, kIn})).sizes(), (std::vector<int64_t>{2, kOut}));
    std::shared_ptr<torch::nn::Module> plain = make_model(0);
    DistributedDataParallel untyped(plain, d);
    EXPECT_THROW(untyped(at::ones({2, kIn})), UsageError);
  });
  EXPECT_EQ(errors, std::vector<std::string>{""});
}

TEST(DDP, UnusedParametersKeepNoGradient) {
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, d, o);
    auto out = ddp.forward([&] { return model->forward(at::ones({2, kIn})); });
    out.sum().backward();
    EXPECT_FALSE(model->head2->weight.grad().defined()) << "globally unused: no gradient";
    EXPECT_TRUE(model->head1->weight.grad().defined());
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
}

TEST(DDP, ParameterUsedOnOneRankOnlyIsAveraged) {
  // head2 is used on rank 1 only: its gradient is rank 1's divided by the world size.
  std::vector<at::Tensor> grads(2);
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, d, o);
    auto out = ddp.forward([&] { return model->forward(at::ones({2, kIn}), d.rank() == 1); });
    out.sum().backward();
    grads[static_cast<size_t>(d.rank())] = model->head2->weight.grad().clone();
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  auto model = make_model(0);
  model->forward(at::ones({2, kIn}), true).sum().backward();
  // Rank 1 ran this very computation; adding rank 0's zero and halving are exact.
  EXPECT_TRUE(at::equal(grads[0], model->head2->weight.grad() / 2));
  EXPECT_TRUE(at::equal(grads[0], grads[1]));
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(DDPErrors, MismatchedModelsNameTheParameterAndRanks) {
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model =
        std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(4, d.rank() == 0 ? 3 : 5));
    DistributedDataParallel ddp(model, d);
  });
  for (auto& e : errors) {
    EXPECT_TRUE(contains(e, "parameter #0 differs between rank 0 and rank 1")) << e;
    EXPECT_TRUE(contains(e, "0.weight Float [3, 4]")) << e;
    EXPECT_TRUE(contains(e, "0.weight Float [5, 4]")) << e;
  }
}

TEST(DDPErrors, MissingGradientsListThemPerRankAndNameTheOption) {
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [&](Dist& d) {
        auto model = make_model(0);
        DistributedDataParallel ddp(model, d);  // find_unused_parameters off
        auto out = ddp.forward([&] { return model->forward(at::ones({2, kIn})); });
        out.sum().backward();
      },
      std::chrono::seconds(10));
  for (auto& e : errors) {
    EXPECT_TRUE(contains(e, "rank 0: head2.weight, head2.bias")) << e;
    EXPECT_TRUE(contains(e, "rank 1: head2.weight, head2.bias")) << e;
    EXPECT_TRUE(contains(e, "find_unused_parameters = true")) << e;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(DDPErrors, UnevenInputsFailOnEveryRankInsteadOfHanging) {
  auto errors = run_ranks(
      2,
      [&](Dist& d) {
        auto model = make_model(0);
        DDPOptions o;
        o.find_unused_parameters = true;
        DistributedDataParallel ddp(model, d, o);
        const int batches = d.rank() == 0 ? 3 : 2;  // rank 1 runs out first
        for (int b = 0; b < batches; ++b) {
          ddp.forward([&] { return model->forward(at::ones({2, kIn})); }).sum().backward();
        }
        ddp.join();
      },
      std::chrono::seconds(10));
  EXPECT_TRUE(contains(errors[0], "rank(s) 1 ran out of batches before step 3"))
      << "[" << errors[0] << "]";
  EXPECT_TRUE(contains(errors[1], "ran out of batches after step 2 while rank(s) 0 still"))
      << errors[1];
}

TEST(DDPErrors, EvenInputsJoinCleanly) {
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model, d, o);
    for (int b = 0; b < 2; ++b) {
      ddp.forward([&] { return model->forward(at::ones({2, kIn})); }).sum().backward();
    }
    ddp.join();
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
}

TEST(DDPErrors, ReplicaDriftIsNamed) {
  auto errors = run_ranks(2, [&](Dist& d) {
    auto model = make_model(0);
    DistributedDataParallel ddp(model, d);
    ddp.check_replicas();  // equal after the broadcast
    if (d.rank() == 1) {
      torch::NoGradGuard g;
      model->head1->bias.add_(1e-3);
    }
    ddp.check_replicas();
  });
  for (auto& e : errors) {
    EXPECT_TRUE(contains(e, "'head1.bias' differs between rank 0 and rank(s) 1")) << e;
  }
}

TEST(DDP, BucketsFollowTheOptions) {
  auto errors = run_ranks(1, [&](Dist& d) {
    auto model = make_model(0);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel big(model, d, o);
    EXPECT_EQ(big.buckets().size(), 1u);  // 0.8 KB in all: one bucket under the 1 MB first cap
    o.first_bucket_cap_mb = o.bucket_cap_mb = 1e-6;  // one byte
    DistributedDataParallel tiny(model, d, o);
    EXPECT_EQ(tiny.buckets().size(), 6u);                                   // one per parameter
    EXPECT_EQ(tiny.parameter_names()[tiny.buckets()[0][0]], "head2.bias");  // last registered
  });
  EXPECT_EQ(errors, std::vector<std::string>{""});
}

}  // namespace
}  // namespace scaletrain
