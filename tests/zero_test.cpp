// Sharded data parallelism (zero.h). Transparency: at every step of stages 1, 2 and 3 over N
// ranks, the averaged gradient the ranks' shards hold, put back together, is the gradient of
// single-process training over the step's whole batch at the weights the ranks hold (Note
// [Tolerances]), every rank holds the same weights bit for bit, and after K steps the weights
// equal DDP's (run beside it, in the same processes) to 1e-5. Memory: the bytes of parameters,
// gradients and optimizer state per rank follow the ZeRO paper's formulas. Checkpoints: saved at
// 4 ranks, loaded at 2 and at 1, training goes on as if never stopped.

#include "scaletrain/zero.h"

#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <mutex>

#include <unistd.h>

#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/tolerance.h"

namespace scaletrain {
namespace {

using testing::run_ranks;
namespace F = torch::nn::functional;

// ---- The plan ------------------------------------------------------------------------------

TEST(ZeroUnits, PlanFollowsTheHandDrawnTable) {
  // Note [Units]: groups 6 3 10 0 2, cap 10, world 4.
  auto units = plan_units({6, 3, 10, 0, 2}, 10, 4);
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ(units[0].first, 0u);
  EXPECT_EQ(units[0].count, 2u);
  EXPECT_EQ(units[0].numel, 9);
  EXPECT_EQ(units[0].padded, 12);
  EXPECT_EQ(units[1].first, 2u);
  EXPECT_EQ(units[1].count, 2u);
  EXPECT_EQ(units[1].numel, 10);
  EXPECT_EQ(units[1].padded, 12);
  EXPECT_EQ(units[2].first, 4u);
  EXPECT_EQ(units[2].numel, 2);
  EXPECT_EQ(units[2].padded, 4);
}

TEST(ZeroUnits, EmptyGroupsJoinTheirNeighboursAndLargeGroupsStandAlone) {
  auto units = plan_units({0, 0, 25, 4, 0}, 10, 1);  // parameterless blocks first and last
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[0].count, 3u);  // 0 0 25: a group over the cap is a unit of its own
  EXPECT_EQ(units[0].numel, 25);
  EXPECT_EQ(units[0].padded, 25);  // a world of one pads nothing
  EXPECT_EQ(units[1].count, 2u);
  EXPECT_EQ(units[1].numel, 4);
  EXPECT_EQ(plan_units({5, 5, 5}, 100, 3).size(), 1u);
  EXPECT_EQ(plan_units({5, 5, 5}, 100, 3)[0].padded, 15);
  EXPECT_EQ(plan_units({7}, 100, 4)[0].padded, 8);
  EXPECT_THROW(plan_units({1}, 10, 0), UsageError);
}

// ---- Transparency --------------------------------------------------------------------------

constexpr int64_t kIn = 7, kHidden = 13, kOut = 5, kPerRank = 3, kSteps = 4;  // 174 parameters

torch::nn::Sequential make_chain(int perturb) {
  static std::mutex mu;  // ranks are threads sharing the global generator
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(0);
  torch::nn::Sequential chain(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(),
                              torch::nn::Linear(kHidden, kOut));
  if (perturb != 0) {
    torch::NoGradGuard g;
    for (auto& p : chain->parameters()) p.add_(0.1 * perturb);  // rank 0's must be broadcast
  }
  return chain;
}

// Any module, not a chain: stages 1 and 2 run it through forward(fn).
struct Wrapped : torch::nn::Module {
  explicit Wrapped(torch::nn::Sequential c) : seq(register_module("seq", std::move(c))) {}
  at::Tensor forward(const at::Tensor& x) { return seq->forward(x); }
  torch::nn::Sequential seq;
};

struct Case {
  int stage = 3;
  int world = 2;
  std::string optimizer = "sgd";
  double unit_cap_mb = 25;
  bool any_module = false;
  bool prefetch = true, reshard_after_forward = true;
  std::optional<at::ScalarType> reduce_dtype;
  bool shared_memory = true;
};

std::string describe(const Case& c) {
  return "stage " + std::to_string(c.stage) + ", world " + std::to_string(c.world) + ", " +
         c.optimizer + (c.unit_cap_mb < 1 ? ", tiny units" : "");
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        const std::vector<at::Tensor>& params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

struct Data {
  at::Tensor x, y;
};
Data make_data(int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  const int64_t n = world * kPerRank * kSteps;
  return {at::randn({n, kIn}, gen), at::randn({n, kOut}, gen)};
}
at::Tensor rows(const at::Tensor& t, int world, int step, int rank) {
  const int64_t global = world * kPerRank;
  if (rank < 0) return t.narrow(0, step * global, global);
  return t.narrow(0, step * global + rank * kPerRank, kPerRank);
}

// The averaged gradient of every parameter, from every rank's shards (collective).
std::vector<at::Tensor> full_gradients(ShardedDataParallel& z) {
  std::vector<at::Tensor> grads(z.module().parameters().size());
  auto params = z.module().parameters();
  auto units = z.unit_parameters();
  for (size_t u = 0; u < units.size(); ++u) {
    auto g = z.parameters()[u].grad();
    auto full = z.dist().size() > 1 ? z.dist().all_gather_into_tensor(g) : g;
    int64_t offset = 0;
    for (size_t i : units[u]) {
      grads[i] = full.narrow(0, offset, params[i].numel()).view(params[i].sizes());
      offset += params[i].numel();
    }
  }
  return grads;
}

// Terms along the longest chain of the gradient (Note [Tolerances]): forward fan-ins (7+1,
// 13+1), the loss (3), the backward's fan-out into the hidden layer (5+1), the batch, and the
// reduction over the ranks with its division.
double terms(int world) { return (8 + 14) + 3 + 6 + world * kPerRank + (1 + world); }

void expect_transparent(const Case& c) {
  const int world = c.world;
  double k = terms(world);
  if (c.reduce_dtype) k = testing::with_narrow_terms(k, world, *c.reduce_dtype);
  std::vector<std::vector<at::Tensor>> final_weights(static_cast<size_t>(world));
  auto errors = run_ranks(world, [&](Dist& d) {
    const auto data = make_data(world);
    auto chain = make_chain(d.rank());
    std::shared_ptr<Wrapped> wrapped;
    ShardOptions o;
    o.stage = c.stage;
    o.unit_cap_mb = c.unit_cap_mb;
    o.prefetch = c.prefetch;
    o.reshard_after_forward = c.reshard_after_forward;
    o.reduce_dtype = c.reduce_dtype;
    o.shared_memory = c.shared_memory;
    std::unique_ptr<ShardedDataParallel> z;
    if (c.any_module) {
      wrapped = std::make_shared<Wrapped>(chain);
      z = std::make_unique<ShardedDataParallel>(wrapped, d, o);
    } else {
      z = std::make_unique<ShardedDataParallel>(chain, d, o);
    }
    auto opt = make_optimizer(c.optimizer, z->parameters());
    // DDP beside it, from the same weights, on the same rows.
    auto ref = make_chain(d.rank());
    DistributedDataParallel ddp(ref, d);
    auto ref_opt = make_optimizer(c.optimizer, ref->parameters());
    for (int s = 0; s < kSteps; ++s) {
      const auto where =
          describe(c) + ", rank " + std::to_string(d.rank()) + ", step " + std::to_string(s);
      auto x = rows(data.x, world, s, d.rank());
      auto y = rows(data.y, world, s, d.rank());
      z->gather_full_parameters();
      const auto weights = testing::weights_of(*chain);
      opt->zero_grad();
      auto out = c.any_module ? z->forward([&] { return wrapped->forward(x); }) : z->forward(x);
      F::mse_loss(out, y).backward();
      auto exact = testing::exact_and_magnitudes(
          [] { return make_chain(0).ptr(); },
          [](torch::nn::Module& m, const at::Tensor& in) {
            return static_cast<torch::nn::SequentialImpl&>(m).forward(in);
          },
          weights, rows(data.x, world, s, -1), testing::mse_gradient(rows(data.y, world, s, -1)));
      testing::expect_gradients_within_rounding(full_gradients(*z), exact, k, where);
      z->step(*opt);

      ref_opt->zero_grad();
      F::mse_loss(ddp(x), y).backward();
      ref_opt->step();
    }
    z->gather_full_parameters();
    final_weights[static_cast<size_t>(d.rank())] = testing::weights_of(*chain);
    auto ref_weights = testing::weights_of(*ref);
    for (size_t i = 0; i < ref_weights.size(); ++i) {
      const double diff = (final_weights[static_cast<size_t>(d.rank())][i] - ref_weights[i])
                              .abs()
                              .max()
                              .item<double>();
      const double tol = c.reduce_dtype ? 1e-2 : 1e-5;  // bf16 on the wire: its 2^-8
      EXPECT_LE(diff, tol) << describe(c) << ", rank " << d.rank() << ": parameter " << i
                           << " after " << kSteps << " steps differs from DDP's";
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << describe(c) << ", rank " << r;
  }
  for (int r = 1; r < world; ++r) {
    for (size_t i = 0; i < final_weights[0].size(); ++i) {
      if (final_weights[static_cast<size_t>(r)].size() <= i) break;
      EXPECT_TRUE(at::equal(final_weights[static_cast<size_t>(r)][i], final_weights[0][i]))
          << describe(c) << ": rank " << r << " parameter " << i << " drifted from rank 0's";
    }
  }
}

class ZeroTransparency : public ::testing::TestWithParam<std::tuple<int, int, std::string>> {};

TEST_P(ZeroTransparency, EqualsSingleProcessAtEveryStepAndDDPAfterK) {
  Case c;
  std::tie(c.stage, c.world, c.optimizer) = GetParam();
  expect_transparent(c);
  c.unit_cap_mb = 1e-4;  // ~100 bytes: one unit per parameter (stages 1, 2) or per block (3)
  expect_transparent(c);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, ZeroTransparency,
    ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(std::string("sgd"), std::string("adam"))),
    [](const auto& p) {
      return "stage" + std::to_string(std::get<0>(p.param)) + "_world" +
             std::to_string(std::get<1>(p.param)) + "_" + std::get<2>(p.param);
    });

// Two backwards before a step (gradient accumulation, every backward reducing) give the sum of
// both micro-batches' averaged gradients, as DDP does: twice the mean gradient over all their
// rows, for every stage, over shared memory and over the backend, for 2 ranks and 3 (where
// stage 1's average times N is not exactly the sum: one more rounding).
TEST(ZeroAccumulation, TwoBackwardsBeforeAStepSumBothAverages) {
  for (int world : {2, 3}) {
    for (int stage : {1, 2, 3}) {
      for (bool shm : {true, false}) {
        const std::string what = "world " + std::to_string(world) + ", stage " +
                                 std::to_string(stage) + (shm ? ", shared memory" : ", backend");
        std::vector<at::Tensor> got, start;
        auto errors = run_ranks(world, [&](Dist& d) {
          const auto data = make_data(world);
          auto chain = make_chain(d.rank());
          ShardOptions o;
          o.stage = stage;
          o.shared_memory = shm;
          ShardedDataParallel z(chain, d, o);
          z.gather_full_parameters();
          if (d.rank() == 0) start = testing::weights_of(*chain);
          for (int s = 0; s < 2; ++s) {
            auto out = z.forward(rows(data.x, world, s, d.rank()));
            F::mse_loss(out, rows(data.y, world, s, d.rank())).backward();
          }
          auto g = full_gradients(z);
          if (d.rank() == 0) got = g;
        });
        for (auto& e : errors) ASSERT_EQ(e, "") << what;
        const auto data = make_data(world);
        const int64_t n = 2 * world * kPerRank;
        auto exact = testing::exact_and_magnitudes(
            [] { return make_chain(0).ptr(); },
            [](torch::nn::Module& m, const at::Tensor& in) {
              return static_cast<torch::nn::SequentialImpl&>(m).forward(in);
            },
            start, data.x.narrow(0, 0, n), testing::mse_gradient(data.y.narrow(0, 0, n)));
        for (auto& t : exact.grads) t = t * 2;  // exact in float64
        for (auto& t : exact.grad_magnitudes) t = t * 2;
        testing::expect_gradients_within_rounding(got, exact, terms(world) + 3, what);
      }
    }
  }
}

TEST(Zero, AnyModuleThroughForwardFnInStagesOneAndTwo) {
  for (int stage : {1, 2}) {
    Case c;
    c.stage = stage;
    c.world = 3;
    c.any_module = true;
    c.unit_cap_mb = 1e-4;
    expect_transparent(c);
  }
}

TEST(Zero, OverTheBackendAloneWithoutSharedMemory) {
  for (int stage : {1, 2, 3}) {
    Case c;
    c.stage = stage;
    c.world = 3;
    c.unit_cap_mb = 1e-4;
    c.shared_memory = false;
    c.optimizer = "adam";
    expect_transparent(c);
  }
}

TEST(Zero, StageThreeWithoutPrefetchOrResharding) {
  Case c;
  c.world = 2;
  c.unit_cap_mb = 1e-4;
  c.prefetch = false;
  expect_transparent(c);
  c.reshard_after_forward = false;
  expect_transparent(c);
}

TEST(Zero, Bf16ReductionWithinItsPrecision) {
  Case c;
  c.world = 2;
  c.unit_cap_mb = 1e-4;
  c.reduce_dtype = at::kBFloat16;
  expect_transparent(c);
}

// ---- The unit life cycle -------------------------------------------------------------------

TEST(Zero, StageThreeHoldsOnlyItsShardsBetweenSteps) {
  auto errors = run_ranks(2, [](Dist& d) {
    auto chain = make_chain(0);
    ShardOptions o;
    o.unit_cap_mb = 1e-4;
    ShardedDataParallel z(chain, d, o);
    ASSERT_EQ(z.units().size(), 2u);  // the two linear layers (the ReLU rides with the first)
    auto params = chain->parameters();
    auto bytes = [&](size_t i) { return params[i].storage().nbytes(); };
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(bytes(i), 0u) << "parameter " << i;
    auto x = at::randn({4, kIn});
    auto out = z(x);
    EXPECT_EQ(bytes(0), 0u) << "the first unit is freed after its forward";
    EXPECT_GT(bytes(2), 0u) << "the last unit stays for its backward";
    out.sum().backward();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(bytes(i), 0u) << "parameter " << i << " after backward";
      EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i << " keeps a full gradient";
    }
    for (auto& s : z.parameters()) EXPECT_TRUE(s.grad().defined());
    {
      torch::NoGradGuard g;
      z(x);
    }
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(bytes(i), 0u) << "after evaluation";
    z.gather_full_parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_GT(bytes(i), 0u);
    auto mine = make_chain(0)->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], mine[i]));
    z.reshard();
    EXPECT_EQ(bytes(0), 0u);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// ShardOptions::ignored_parameters: the second layer's weight is left out of the units (whole
// and this rank's own: not broadcast, its gradient local), at every stage; with param_dtype it
// is refused.
TEST(Zero, IgnoredParametersStayWholeAndLocal) {
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto errors = run_ranks(2, [stage](Dist& d) {
      auto chain = make_chain(d.rank());  // rank 1's weights differ from rank 0's
      const at::Tensor own = chain->parameters()[2];
      const at::Tensor before = own.detach().clone();
      ShardOptions o;
      o.stage = stage;
      o.ignored_parameters = {own};
      ShardedDataParallel z(chain, d, o);
      for (const auto& [name, t] : z.named_parameters()) {
        EXPECT_NE(t.unsafeGetTensorImpl(), own.unsafeGetTensorImpl()) << name << " is sharded";
      }
      EXPECT_TRUE(at::equal(own, before)) << "the ignored weight was broadcast";
      auto x = at::randn({4, kIn});
      z(x).sum().backward();
      ASSERT_TRUE(own.grad().defined());
      EXPECT_EQ(own.grad().sizes(), own.sizes()) << "its gradient is whole, here";
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
  }
  auto errors = run_ranks(1, [](Dist& d) {
    auto chain = make_chain(0);
    ShardOptions o;
    o.param_dtype = at::kBFloat16;
    o.ignored_parameters = {chain->parameters()[2]};
    ShardedDataParallel z(chain, d, o);
  });
  EXPECT_NE(errors[0].find("ignored_parameters with param_dtype"), std::string::npos) << errors[0];
}

// ---- Memory: the ZeRO paper's formulas -----------------------------------------------------

torch::nn::Sequential make_wide() {
  torch::manual_seed(1);
  torch::nn::Sequential s;
  for (int i = 0; i < 4; ++i) {
    s->push_back(torch::nn::Linear(256, 256));
    s->push_back(torch::nn::ReLU());
  }
  return s;
}

TEST(ZeroMemory, ModelStatePerRankFollowsTheZeroFormulas) {
  // Ψ parameters in fp32 with Adam (two moments), in bytes: DDP 16Ψ; stage 1 4Ψ + 4Ψ + 8Ψ/N; stage
  // 2 4Ψ + 12Ψ/N; stage 3 16Ψ/N (Rajbhandari et al.), measured from the live storages after a
  // step, with the units padded to a multiple of N (at most N − 1 elements each). With bf16
  // parameters over fp32 masters (Note [Mixed precision]): stage 1 2Ψ + 2Ψ + 16Ψ/N, stage 2
  // 2Ψ + 16Ψ/N, stage 3 16Ψ/N.
  const double psi = 4 * (256 * 256 + 256);  // four layers' parameters
  for (bool mixed : {false, true}) {
    for (int world : {2, 4}) {
      for (int stage : {1, 2, 3}) {
        std::vector<ShardMemory> got(static_cast<size_t>(world));
        auto errors = run_ranks(world, [&](Dist& d) {
          auto chain = make_wide();
          ShardOptions o;
          o.stage = stage;
          o.unit_cap_mb = mixed ? 0.15 : 0.3;  // one linear layer per unit
          if (mixed) o.param_dtype = at::kBFloat16;
          ShardedDataParallel z(chain, d, o);
          torch::optim::Adam opt(z.parameters(), 1e-3);
          auto x = at::randn({8, 256});
          opt.zero_grad();
          z(x).square().mean().backward();
          z.step(opt);
          got[static_cast<size_t>(d.rank())] = z.memory(&opt);
        });
        for (auto& e : errors) ASSERT_EQ(e, "");
        const double n = world;
        const double fp32[] = {0, 4 * psi + 4 * psi + 8 * psi / n, 4 * psi + 12 * psi / n,
                               16 * psi / n};
        const double bf16[] = {0, 2 * psi + 2 * psi + 16 * psi / n, 2 * psi + 16 * psi / n,
                               16 * psi / n};
        const double* expected = mixed ? bf16 : fp32;
        for (int r = 0; r < world; ++r) {
          const auto& m = got[static_cast<size_t>(r)];
          const double total = static_cast<double>(m.total());
          const auto where = std::string(mixed ? "bf16 parameters, " : "") + "stage " +
                             std::to_string(stage) + ", world " + std::to_string(world) +
                             ", rank " + std::to_string(r);
          EXPECT_GE(total, expected[stage]) << where;
          EXPECT_LE(total, 1.10 * expected[stage])
              << where << ": parameters " << m.parameters << ", gradients " << m.gradients
              << ", optimizer " << m.optimizer;
          EXPECT_NEAR(static_cast<double>(m.optimizer), 8 * psi / n, 8 * 4 * n) << where;
        }
      }
    }
  }
}

// ---- Checkpoints ---------------------------------------------------------------------------

struct CheckpointDir {
  CheckpointDir() {
    static int count = 0;
    dir = std::filesystem::temp_directory_path() /
          ("scaletrain_zero_" + std::to_string(getpid()) + "_" + std::to_string(count++));
    std::filesystem::remove_all(dir);
  }
  ~CheckpointDir() { std::filesystem::remove_all(dir); }
  std::string path() const { return dir.string(); }
  std::filesystem::path dir;
};

// Trains `steps` steps of the global batch from step `from` on `world` ranks of stage 3 with
// Adam, after loading `load_dir`'s step `from` when given; saves to `save_dir` when given;
// returns the weights.
std::vector<at::Tensor> train_zero(int world, int from, int steps, const std::string& load_dir,
                                   const std::string& save_dir, int stage = 3,
                                   std::optional<at::ScalarType> param_dtype = {}) {
  std::vector<at::Tensor> weights;
  const int64_t global = 12;  // rows per step, whatever the world
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto xs = at::randn({global * 8, kIn}, gen), ys = at::randn({global * 8, kOut}, gen);
  auto errors = run_ranks(world, [&](Dist& d) {
    auto chain = make_chain(0);
    ShardOptions o;
    o.stage = stage;
    o.unit_cap_mb = 1e-4;
    o.param_dtype = param_dtype;
    ShardedDataParallel z(chain, d, o);
    torch::optim::Adam opt(z.parameters(), 0.01);
    if (!load_dir.empty()) {
      auto st = z.load(load_dir, from, opt);
      EXPECT_EQ(st.global_step, from);
      EXPECT_TRUE(st.optimizer_restored);
    }
    const int64_t per = global / world;
    for (int s = from; s < from + steps; ++s) {
      opt.zero_grad();
      auto x = xs.narrow(0, s * global + d.rank() * per, per);
      auto y = ys.narrow(0, s * global + d.rank() * per, per);
      F::mse_loss(z(x).to(at::kFloat), y).backward();
      z.step(opt);
    }
    if (!save_dir.empty()) {
      TrainingState st;
      st.run_id = "zero-test";
      st.model_name = "chain";
      st.global_step = from + steps;
      z.save(save_dir, st, opt, 2);
    }
    z.gather_full_parameters();
    if (d.rank() == 0) weights = testing::weights_of(*chain);
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
  return weights;
}

TEST(ZeroCheckpoint, SavedAtFourLoadsAtTwoAndAtOneAndGoesOnAsIfNeverStopped) {
  CheckpointDir dir;
  const auto straight = train_zero(4, 0, 4, "", "");
  train_zero(4, 0, 2, "", dir.path());
  for (int world : {4, 2, 1}) {
    const auto resumed = train_zero(world, 2, 2, dir.path(), "");
    ASSERT_EQ(resumed.size(), straight.size());
    for (size_t i = 0; i < straight.size(); ++i) {
      if (world == 4) {  // the same world: the same arithmetic, the same bits
        EXPECT_TRUE(at::equal(resumed[i], straight[i])) << "parameter " << i;
      } else {  // other reduction groupings: within rounding of two Adam steps
        EXPECT_LE((resumed[i] - straight[i]).abs().max().item<double>(), 1e-5)
            << "world " << world << ", parameter " << i;
      }
    }
  }
  EXPECT_EQ(newest_sharded_checkpoint(dir.path()), std::optional<int64_t>(2));
}

TEST(ZeroCheckpoint, StagesShareOneFormat) {
  CheckpointDir dir;
  const auto straight = train_zero(2, 0, 4, "", "", 1);
  train_zero(2, 0, 2, "", dir.path(), 1);  // saved by stage 1, loaded by stage 3
  const auto resumed = train_zero(2, 2, 2, dir.path(), "", 3);
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_LE((resumed[i] - straight[i]).abs().max().item<double>(), 1e-5) << "parameter " << i;
  }
}

TEST(ZeroCheckpoint, LoadErrorsNameTheWorldTheFileAndTheParameter) {
  CheckpointDir dir;
  train_zero(2, 0, 1, "", dir.path());
  auto errors = run_ranks(1, [&](Dist& d) {
    auto chain = make_chain(0);
    ShardedDataParallel z(chain, d);
    torch::optim::Adam opt(z.parameters(), 0.01);
    z.load(dir.path(), 1, opt, /*reshard=*/false);
  });
  EXPECT_NE(errors[0].find("saved by 2 ranks, this world has 1"), std::string::npos) << errors[0];
  errors = run_ranks(1, [&](Dist& d) {
    torch::nn::Sequential other(torch::nn::Linear(kIn, kHidden + 1), torch::nn::ReLU(),
                                torch::nn::Linear(kHidden + 1, kOut));
    ShardedDataParallel z(other, d);
    torch::optim::Adam opt(z.parameters(), 0.01);
    z.load(dir.path(), 1, opt);
  });
  EXPECT_NE(errors[0].find("of another model: parameter #0"), std::string::npos) << errors[0];
  errors = run_ranks(1, [&](Dist& d) {
    auto chain = make_chain(0);
    ShardedDataParallel z(chain, d);
    torch::optim::SGD opt(z.parameters(), 0.01);
    z.load(dir.path(), 1, opt);
  });
  EXPECT_NE(errors[0].find("'adam' optimizer, not of a 'sgd'"), std::string::npos) << errors[0];
  std::filesystem::remove(checkpoint_path(dir.path() + "/world-2/rank-1", 1));
  errors = run_ranks(1, [&](Dist& d) {
    auto chain = make_chain(0);
    ShardedDataParallel z(chain, d);
    torch::optim::Adam opt(z.parameters(), 0.01);
    z.load(dir.path(), 1, opt);
  });
  EXPECT_NE(errors[0].find("no complete sharded checkpoint of step 1"), std::string::npos)
      << errors[0];
  EXPECT_EQ(newest_sharded_checkpoint(dir.path()), std::nullopt);
}

// ---- Mixed precision (Note [Mixed precision]) ----------------------------------------------

// bf16 parameters over fp32 masters, reduced in fp32, a unit per parameter or block.
ShardOptions bf16_options(int stage) {
  ShardOptions o;
  o.stage = stage;
  o.unit_cap_mb = 1e-4;
  o.param_dtype = at::kBFloat16;
  o.reduce_dtype = at::kFloat;
  return o;
}

// One rank's bf16 replica of the chain at the masters' values rounded to bf16: the gradient a
// plain bf16 model computes on the rank's rows, in fp32.
std::vector<at::Tensor> bf16_replica_gradients(const std::vector<at::Tensor>& masters,
                                               const at::Tensor& x, const at::Tensor& y) {
  auto replica = make_chain(0);
  replica->to(at::kBFloat16);
  {
    torch::NoGradGuard g;
    auto ps = replica->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(masters[i]);
  }
  F::mse_loss(replica->forward(x.to(at::kBFloat16)).to(at::kFloat), y).backward();
  std::vector<at::Tensor> out;
  for (auto& p : replica->parameters()) out.push_back(p.grad().to(at::kFloat));
  return out;
}

// bf16 parameters over fp32 masters, gradients reduced in fp32: at every step each rank
// computes what a bf16 replica at the masters' rounded values computes, the shards hold the
// replicas' gradients averaged in fp32 (bit for bit at 2 ranks, where the sum of two is exact in
// either order; within its rounding at 3), the masters keep fp32 precision, and the ranks'
// masters stay equal bit for bit; at 2 ranks the masters equal an fp32 SGD over the replicas'
// averaged gradients, bit for bit, after every step.
TEST(ZeroMixedPrecision, Bf16ComputeOverFp32MastersIsTheAverageOfBf16Replicas) {
  for (int world : {2, 3}) {
    for (int stage : {1, 2, 3}) {
      for (bool shm : {true, false}) {
        if (world == 3 && shm) continue;
        const std::string what = "world " + std::to_string(world) + ", stage " +
                                 std::to_string(stage) + (shm ? ", shared memory" : ", backend");
        std::vector<std::vector<at::Tensor>> finals(static_cast<size_t>(world));
        auto errors = run_ranks(world, [&](Dist& d) {
          const auto data = make_data(world);
          auto chain = make_chain(d.rank());
          ShardOptions o = bf16_options(stage);
          o.shared_memory = shm;
          auto wrapped = std::make_shared<Wrapped>(chain);
          auto z = stage == 3 ? std::make_unique<ShardedDataParallel>(chain, d, o)
                              : std::make_unique<ShardedDataParallel>(wrapped, d, o);
          for (auto& s : z->parameters()) ASSERT_EQ(s.scalar_type(), at::kFloat) << what;
          torch::optim::SGD opt(z->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          // The reference: fp32 masters stepped by SGD on the replicas' averaged gradients.
          z->gather_full_parameters();
          auto ref = testing::weights_of(*chain);
          for (auto& t : ref) t.requires_grad_(true);
          torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.1).momentum(0.9));
          for (int s = 0; s < kSteps; ++s) {
            const auto where =
                what + ", rank " + std::to_string(d.rank()) + ", step " + std::to_string(s);
            auto x = rows(data.x, world, s, d.rank());
            auto y = rows(data.y, world, s, d.rank());
            z->gather_full_parameters();
            const auto masters = testing::weights_of(*chain);
            for (auto& m : masters) ASSERT_EQ(m.scalar_type(), at::kFloat) << where;
            if (world == 2) {
              for (size_t i = 0; i < masters.size(); ++i) {
                EXPECT_TRUE(at::equal(masters[i], ref[i].detach()))
                    << where << ": master " << i << " is not fp32 SGD's";
              }
            }
            auto expected = bf16_replica_gradients(masters, x, y);
            std::vector<at::Tensor> magnitude;
            for (auto& g : expected) {
              auto m = g.abs();
              d.all_reduce(g);
              d.all_reduce(m);
              g.div_(world);
              magnitude.push_back(m / world);
            }
            opt.zero_grad();
            auto out = stage == 3
                           ? z->forward(x)
                           : z->forward([&] { return wrapped->forward(x.to(at::kBFloat16)); });
            for (auto& p : chain->parameters()) {
              ASSERT_EQ(p.scalar_type(), at::kBFloat16) << where << ": the compute copies";
            }
            ASSERT_EQ(out.scalar_type(), at::kBFloat16) << where;
            F::mse_loss(out.to(at::kFloat), y).backward();
            const auto got = full_gradients(*z);
            for (size_t i = 0; i < got.size(); ++i) {
              if (world == 2) {
                EXPECT_TRUE(at::equal(got[i], expected[i])) << where << ": gradient " << i;
              } else {  // N terms summed in fp32 in some order, then divided
                const double bound = testing::gamma(world + 1) * magnitude[i].max().item<double>();
                EXPECT_LE((got[i] - expected[i]).abs().max().item<double>(), bound)
                    << where << ": gradient " << i;
              }
              ref[i].mutable_grad() = expected[i].clone();
            }
            z->step(opt);
            ref_opt.step();
          }
          z->gather_full_parameters();
          finals[static_cast<size_t>(d.rank())] = testing::weights_of(*chain);
        });
        for (auto& e : errors) ASSERT_EQ(e, "") << what;
        double lost = 0;  // the masters' bits below bf16's
        for (auto& m : finals[0]) {
          lost =
              std::max(lost, (m - m.to(at::kBFloat16).to(at::kFloat)).abs().max().item<double>());
        }
        EXPECT_GT(lost, 0) << what << ": the masters hold only bf16 values";
        for (int r = 1; r < world; ++r) {
          for (size_t i = 0; i < finals[0].size(); ++i) {
            EXPECT_TRUE(at::equal(finals[static_cast<size_t>(r)][i], finals[0][i]))
                << what << ": rank " << r << " parameter " << i;
          }
        }
      }
    }
  }
}

// Two backwards before a step (gradient accumulation) with bf16 compute: each reduction's fp32
// average is added into the shard's gradient (stage 1's bf16 buffer starts from zero again),
// so the shards hold the sum of both steps' bf16 replica averages, bit for bit at 2 ranks. And
// a frozen parameter computes in bf16 with the others.
TEST(ZeroMixedPrecision, TwoBackwardsBeforeAStepSumBothAveragesAndFrozenParametersFollow) {
  for (int stage : {1, 2, 3}) {
    const std::string what = "stage " + std::to_string(stage);
    auto errors = run_ranks(2, [&](Dist& d) {
      const auto data = make_data(2);
      auto chain = make_chain(d.rank());
      ShardedDataParallel z(chain, d, bf16_options(stage));
      z.gather_full_parameters();
      const auto masters = testing::weights_of(*chain);
      std::vector<at::Tensor> expected;
      for (int s = 0; s < 2; ++s) {
        auto x = rows(data.x, 2, s, d.rank()), y = rows(data.y, 2, s, d.rank());
        auto g = bf16_replica_gradients(masters, x, y);
        for (size_t i = 0; i < g.size(); ++i) {
          d.all_reduce(g[i]);
          g[i].div_(2);
          if (s == 0) {
            expected.push_back(g[i]);
          } else {
            expected[i] = expected[i] + g[i];
          }
        }
        F::mse_loss(z(x).to(at::kFloat), y).backward();
      }
      const auto got = full_gradients(z);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i], expected[i])) << what << ": gradient " << i;
      }
    });
    for (auto& e : errors) EXPECT_EQ(e, "") << what;
  }
  auto errors = run_ranks(2, [&](Dist& d) {
    auto chain = make_chain(0);
    chain[0]->as<torch::nn::Linear>()->bias.requires_grad_(false);  // frozen: not sharded
    ShardOptions o;
    o.stage = 2;
    o.param_dtype = at::kBFloat16;
    ShardedDataParallel z(chain, d, o);
    EXPECT_EQ(chain[0]->as<torch::nn::Linear>()->bias.scalar_type(), at::kBFloat16);
    auto out = z.forward([&] { return chain->forward(at::randn({2, kIn}).to(at::kBFloat16)); });
    out.to(at::kFloat).sum().backward();
    torch::optim::SGD opt(z.parameters(), 0.1);
    z.step(opt);
  });
  for (auto& e : errors) EXPECT_EQ(e, "") << "frozen bias";
}

// The module holds the compute copies or the masters: what is loaded into the masters reaches
// the shards bit for bit (a bf16 round trip would lose the low bits), the next forward computes
// with the loaded values rounded, and its backward still reaches the reduction (the parameters'
// new gradient accumulators are hooked).
TEST(ZeroMixedPrecision, MastersLoadedIntoTheModuleReachTheShardsLosslessly) {
  for (int stage : {1, 2, 3}) {
    auto errors = run_ranks(2, [&](Dist& d) {
      auto chain = make_chain(0);
      ShardOptions o;
      o.stage = stage;
      o.unit_cap_mb = 1e-4;
      o.param_dtype = at::kBFloat16;
      auto wrapped = std::make_shared<Wrapped>(chain);
      auto z = stage == 3 ? std::make_unique<ShardedDataParallel>(chain, d, o)
                          : std::make_unique<ShardedDataParallel>(wrapped, d, o);
      EXPECT_THROW(z->scatter_full_parameters(), UsageError);  // the module holds bf16 copies
      z->gather_full_parameters();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
      std::vector<at::Tensor> loaded;
      {
        torch::NoGradGuard g;
        for (auto& p : chain->parameters()) {
          loaded.push_back(at::randn(p.sizes(), gen));
          p.copy_(loaded.back());
        }
      }
      z->scatter_full_parameters();
      z->reshard();
      for (auto& p : chain->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
      z->gather_full_parameters();
      auto back = testing::weights_of(*chain);
      for (size_t i = 0; i < back.size(); ++i) {
        EXPECT_TRUE(at::equal(back[i], loaded[i])) << "stage " << stage << ", parameter " << i;
      }
      auto x = at::randn({4, kIn}, gen);
      auto out = stage == 3 ? z->forward(x)
                            : z->forward([&] { return wrapped->forward(x.to(at::kBFloat16)); });
      auto expected = make_chain(0);
      expected->to(at::kBFloat16);
      {
        torch::NoGradGuard g;
        auto ps = expected->parameters();
        for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(loaded[i]);
      }
      EXPECT_TRUE(at::equal(out, expected->forward(x.to(at::kBFloat16)))) << "stage " << stage;
      out.to(at::kFloat).sum().backward();
      torch::optim::SGD opt(z->parameters(), 0.1);
      z->step(opt);  // throws if a gradient did not reach its unit
    });
    for (auto& e : errors) EXPECT_EQ(e, "") << "stage " << stage;
  }
}

TEST(ZeroMixedPrecision, SavedAndLoadedGoesOnAsIfNeverStopped) {
  CheckpointDir dir;
  for (int stage : {1, 2, 3}) {
    const auto straight = train_zero(2, 0, 4, "", "", stage, at::kBFloat16);
    train_zero(2, 0, 2, "", dir.path(), stage, at::kBFloat16);
    const auto resumed = train_zero(2, 2, 2, dir.path(), "", stage, at::kBFloat16);
    ASSERT_EQ(resumed.size(), straight.size());
    for (size_t i = 0; i < straight.size(); ++i) {
      EXPECT_EQ(resumed[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(resumed[i], straight[i])) << "stage " << stage << ", parameter " << i;
    }
    // The checkpoint holds the fp32 masters: an fp32 run loads them as they were.
    const auto at_two = train_zero(2, 0, 2, "", "", stage, at::kBFloat16);
    const auto loaded = train_zero(2, 2, 0, dir.path(), "", stage);
    for (size_t i = 0; i < at_two.size(); ++i) {
      EXPECT_TRUE(at::equal(loaded[i], at_two[i])) << "stage " << stage << ", parameter " << i;
    }
  }
}

// ---- Misuse --------------------------------------------------------------------------------

TEST(ZeroErrors, EachNamesTheFix) {
  auto errors = run_ranks(1, [](Dist& d) {
    auto wrapped = std::make_shared<Wrapped>(make_chain(0));
    ShardOptions o;
    o.stage = 3;
    ShardedDataParallel z(wrapped, d, o);
  });
  EXPECT_NE(errors[0].find("needs the model as a chain"), std::string::npos) << errors[0];
  errors = run_ranks(1, [](Dist& d) {
    ShardOptions o;
    o.stage = 4;
    ShardedDataParallel z(make_chain(0), d, o);
  });
  EXPECT_NE(errors[0].find("stage 4 does not exist"), std::string::npos) << errors[0];
  errors = run_ranks(1, [](Dist& d) {
    ShardOptions o;
    o.param_dtype = at::kInt;
    ShardedDataParallel z(make_chain(0), d, o);
  });
  EXPECT_NE(errors[0].find("param_dtype = Int is not a floating-point dtype"), std::string::npos)
      << errors[0];
  errors = run_ranks(1, [](Dist& d) {
    ShardOptions o;
    o.buffer_dtype = at::kBFloat16;
    ShardedDataParallel z(make_chain(0), d, o);
  });
  EXPECT_NE(errors[0].find("buffer_dtype goes with a param_dtype"), std::string::npos) << errors[0];
  errors = run_ranks(1, [](Dist& d) {
    ShardOptions o;
    o.unit_memory_budget_mb = 1e-4;  // 105 bytes; the first layer gathers 416
    o.unit_cap_mb = 1e-4;
    ShardedDataParallel z(make_chain(0), d, o);
  });
  EXPECT_NE(errors[0].find("unit 0 (0.weight .. 0.bias) gathers"), std::string::npos) << errors[0];
  errors = run_ranks(2, [](Dist& d) {
    // A head that forward never uses: its gradients never come, and step() says so.
    struct TwoHeads : torch::nn::Module {
      TwoHeads() {
        a = register_module("a", torch::nn::Linear(kIn, kOut));
        unused = register_module("unused", torch::nn::Linear(kIn, kOut));
      }
      torch::nn::Linear a{nullptr}, unused{nullptr};
    };
    auto m = std::make_shared<TwoHeads>();
    ShardOptions o;
    o.stage = 2;
    ShardedDataParallel z(m, d, o);
    torch::optim::SGD opt(z.parameters(), 0.1);
    auto x = at::randn({2, kIn});
    z.forward([&] { return m->a->forward(x); }).sum().backward();
    z.step(opt);
  });
  for (auto& e : errors) {
    EXPECT_NE(e.find("no gradient reached: unused.weight, unused.bias"), std::string::npos) << e;
  }
  errors = run_ranks(2, [](Dist& d) {
    auto chain = make_chain(0);
    if (d.rank() == 1) chain->push_back(torch::nn::Linear(kOut, 1));
    ShardedDataParallel z(chain, d);
  });
  for (auto& e : errors)
    EXPECT_NE(e.find("needs the same model on every rank"), std::string::npos) << e;
}

}  // namespace
}  // namespace scaletrain
