// Tensor and sequence parallelism (tensor_parallel.h) and the zoo's GPT split by it: the
// conjugate operators value by value, the vocabulary-parallel cross entropy against the full one,
// and transparency — a model split over 2 or 4 ranks gives the single process's loss, gradients
// and weights at every step.
//
// Note [Tensor-parallel tolerance]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A transformer has softmax, LayerNorm and GELU, so Note [Tolerances]' magnitude trick does not
// bound it. These tests compute both sides in float64 instead. The split model does the same
// arithmetic as the whole one, grouped differently: a dot product over the features is summed
// per rank over its slice, then over the ranks. Each result of either side errs from the exact
// value by at most gamma(K)·M (Higham §3.1), with K the terms along its longest chain of sums
// (here ≤ 4·width·layers + the batch's tokens ≈ 10^3, so gamma(K) ≤ 1.2e-13 in float64) and M
// the sum of the absolute values of those terms. For these unit-scale models (LayerNorm'd
// activations, weights N(0, 0.02), two blocks) M stays within 10^3 of the result's own scale,
// so the two sides differ by at most 2·1.2e-13·10^3 ≈ 2.4e-10 of the largest entry: the bound
// below is 1e-9 of it (plus 1e-13 for an all-but-zero tensor). A missing all-reduce or
// reduce-scatter errs by the size of the result itself, seven orders of magnitude outside it,
// on any CPU and summation order.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <map>
#include <set>
#include <string>

#include "gpt.h"
#include "scaletrain/blocks.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"
#include "scaletrain/mesh.h"
#include "scaletrain/tensor_parallel.h"
#include "scaletrain/zero.h"
#include "support/ranks.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = want.abs().max().item<double>();
  const double bound = 1e-9 * scale + 1e-13;
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(err, bound) << what << ": off by " << err << " (bound " << bound << ")";
}

std::vector<std::string> no_errors(int n) {
  return std::vector<std::string>(static_cast<size_t>(n));
}

// ---- The operators, value by value (small integers in float64: every sum exact) --------------

class TensorParallelOps : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelOps, EachOperatorAndItsGradient) {
  const int n = GetParam();
  auto errors = testing::run_ranks(n, [&](Dist& d) {
    const double r = d.rank();
    const auto opts = at::TensorOptions().dtype(at::kDouble);
    // f: identity forward, gradient summed.
    auto x = at::full({2, 3}, r + 1, opts).requires_grad_();
    auto y = copy_to_region(x, d);
    EXPECT_TRUE(at::equal(y, at::full({2, 3}, r + 1, opts)));
    (y * (r + 1)).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), at::full({2, 3}, n * (n + 1) / 2.0, opts)));
    // g: summed forward, gradient as it is.
    x = at::full({2, 3}, r + 1, opts).requires_grad_();
    y = reduce_from_region(x, d);
    EXPECT_TRUE(at::equal(y, at::full({2, 3}, n * (n + 1) / 2.0, opts)));
    (y * (r + 1)).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), at::full({2, 3}, r + 1, opts)));
    // Sequence all-gather along dim 1; its gradient reduce-scattered back.
    x = at::full({2, 2, 3}, r, opts).requires_grad_();
    y = gather_from_sequence(x, d, 1);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 2 * n, 3}));
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(at::equal(y.narrow(1, 2 * i, 2), at::full({2, 2, 3}, double(i), opts)));
    }
    auto w = at::arange(2 * n, opts).view({1, 2 * n, 1}) * (r + 1);  // rank-dependent weights
    (y * w).sum().backward();
    auto want =
        at::arange(2 * n, opts).narrow(0, 2 * d.rank(), 2).view({1, 2, 1}) * (n * (n + 1) / 2.0);
    EXPECT_TRUE(at::equal(x.grad(), want.expand({2, 2, 3})));
    // Sequence reduce-scatter; its gradient gathered.
    x = (at::arange(2 * n, opts).view({1, 2 * n, 1}) + r).expand({2, 2 * n, 3}).clone();
    x.requires_grad_();
    y = reduce_scatter_to_sequence(x, d, 1);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 2, 3}));
    auto mine =
        at::arange(2 * n, opts).narrow(0, 2 * d.rank(), 2).view({1, 2, 1}) * n + n * (n - 1) / 2.0;
    EXPECT_TRUE(at::equal(y, mine.expand({2, 2, 3})));
    (y * (r + 1)).sum().backward();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(at::equal(x.grad().narrow(1, 2 * i, 2), at::full({2, 2, 3}, i + 1.0, opts)));
    }
    // Scatter (own slice, no communication) and gather of a replicated tensor.
    x = at::arange(4 * n, opts).view({1, 4 * n}).requires_grad_();
    y = scatter_to_sequence(x, d, 1);
    EXPECT_TRUE(at::equal(y, at::arange(4 * d.rank(), 4 * d.rank() + 4, opts).view({1, 4})));
    (y * (r + 1)).sum().backward();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(at::equal(x.grad().narrow(1, 4 * i, 4), at::full({1, 4}, i + 1.0, opts)));
    }
    x = at::full({3, 1}, r, opts).requires_grad_();
    y = gather_from_region(x, d, -1);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, n}));
    (y * at::arange(n, opts)).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), at::full({3, 1}, r, opts)));
    // A sequence that does not split evenly is refused, on every rank alike.
    if (n > 1) {
      EXPECT_THROW(reduce_scatter_to_sequence(at::zeros({1, 2 * n + 1, 2}, opts), d, 1),
                   UsageError);
    }
  });
  EXPECT_EQ(errors, no_errors(n));
}

INSTANTIATE_TEST_SUITE_P(Degrees, TensorParallelOps, ::testing::Values(1, 2, 3, 4));

// ---- The vocabulary-parallel cross entropy ----------------------------------------------------

TEST(TensorParallel, VocabParallelCrossEntropyEqualsTheFullOne) {
  for (int n : {2, 4}) {
    const int64_t vocab = 12;
    auto logits = at::randn({2, 5, vocab}, at::kDouble) * 3;
    // Targets on every slice, one on the last rank's slice, and an ignored token.
    auto targets = at::tensor({0, 11, 5, 3, -100, 7, 8, 1, 10, 2}, at::kLong).view({2, 5});
    auto whole = logits.clone().requires_grad_();
    auto want = at::cross_entropy_loss(whole.view({-1, vocab}), targets.view({-1}), {},
                                       at::Reduction::Mean, -100);
    want.backward();
    auto errors = testing::run_ranks(n, [&](Dist& d) {
      const int64_t vl = vocab / n;
      auto mine = logits.narrow(-1, d.rank() * vl, vl).clone().requires_grad_();
      auto loss = vocab_parallel_cross_entropy(mine, targets, d);
      expect_close(loss, want.detach(), "loss");
      loss.backward();
      expect_close(mine.grad(), whole.grad().narrow(-1, d.rank() * vl, vl), "logits' gradient");
      // Every target ignored: NaN, as PyTorch's mean over no tokens.
      auto none = at::full({2, 5}, -100, at::kLong);
      EXPECT_TRUE(std::isnan(vocab_parallel_cross_entropy(mine, none, d).item<double>()));
      // A target outside the vocabulary is named (every rank sees it).
      auto bad = targets.clone();
      bad[1][2] = vocab;
      try {
        vocab_parallel_cross_entropy(mine, bad, d);
        ADD_FAILURE() << "no error for target " << vocab;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("target 12 of token 7"), std::string::npos)
            << e.what();
      }
    });
    EXPECT_EQ(errors, no_errors(n)) << "tp " << n;
  }
}

// ---- A user's block, split by a plan ----------------------------------------------------------

struct MlpImpl : torch::nn::Module {
  ParallelLinear fc{nullptr}, proj{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  MlpImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    fc = register_module("fc", ParallelLinear(8, 16));
    proj = register_module("proj", ParallelLinear(16, 8));
  }
  at::Tensor forward(const at::Tensor& x) { return x + proj(at::gelu(fc(ln(x)))); }
};
TORCH_MODULE(Mlp);

void copy_state(torch::nn::Module& to, const torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(src[p.key()]);
}

TEST(TensorParallel, AUsersBlockSplitByAPlanEqualsTheWholeBlock) {
  Mlp whole;
  whole->to(at::kDouble);
  auto x = at::randn({2, 4, 8}, at::kDouble);
  auto out = whole->forward(x);
  (out * out).sum().backward();
  for (int n : {2, 4}) {
    for (bool sp : {false, true}) {
      auto errors = testing::run_ranks(n, [&](Dist& d) {
        Mlp m;
        m->to(at::kDouble);
        copy_state(*m, *whole);
        parallelize_module(*m, d, {{"fc", colwise(1, sp)}, {"proj", rowwise(sp)}});
        EXPECT_EQ(m->fc->weight.size(0), 16 / n);
        EXPECT_EQ(m->proj->weight.size(1), 16 / n);
        at::Tensor in = sp ? x.narrow(1, d.rank() * 4 / n, 4 / n).contiguous() : x;
        auto y = m->forward(in);
        // Every rank takes the whole output's loss: the gathered output's gradient is the same
        // everywhere, so the gather's backward keeps this rank's slice (gather_from_region), not
        // the sum of every rank's (gather_from_sequence, for a consumer with partial gradients).
        if (sp) y = gather_from_region(y, d, 1);
        expect_close(y, out, "output");
        (y * y).sum().backward();
        if (sp) sync_sequence_parallel_grads(replicated_parameters(*m), d);
        auto grads = gather_full_state(*m, d, /*gradients=*/true);
        for (const auto& p : whole->named_parameters()) {
          expect_close(grads.at(p.key()), p.value().grad(), p.key() + "'s gradient");
        }
        auto state = gather_full_state(*m, d);
        for (const auto& p : whole->named_parameters()) {
          EXPECT_TRUE(at::equal(state.at(p.key()), p.value())) << p.key();
        }
      });
      EXPECT_EQ(errors, no_errors(n))
          << "tp " << n << (sp ? " with" : " without") << " sequence parallelism";
    }
  }
}

TEST(TensorParallel, BadPlansAreNamed) {
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    auto expect = [&](const TensorParallelPlan& plan, const std::string& part) {
      Mlp m;
      try {
        parallelize_module(*m, d, plan);
        ADD_FAILURE() << "no error for a plan that should fail with: " << part;
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    expect({{"fc2", colwise()}}, "'fc2' is not a submodule");
    expect({{"ln", colwise()}}, "only a scaletrain::ParallelLinear or ParallelEmbedding");
    expect({{"fc", vocab_parallel()}}, "vocab_parallel() is for a ParallelEmbedding");
    expect({{"fc", colwise(3)}}, "output features (16) does not divide by 6");
    Mlp m;
    parallelize_module(*m, d, {{"fc", colwise()}});
    EXPECT_THROW(parallelize_module(*m, d, {{"fc", colwise()}}), UsageError);
  });
  EXPECT_EQ(errors, no_errors(2));
}

// ---- The zoo's GPT: transparency over steps ----------------------------------------------------

GPTConfig small_gpt(bool tied = true, double dropout = 0) {
  GPTConfig c;
  c.tied_head = tied;
  c.dropout = dropout;
  c.vocab_size = 16;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  return c;
}

// Three SGD steps of the whole model (float64): each step's loss, gradients and weights after.
struct Trajectory {
  std::vector<at::Tensor> losses;
  std::vector<std::map<std::string, at::Tensor>> grads, weights;
};

Trajectory whole_run(GPT& model, const at::Tensor& ids, const at::Tensor& targets, int steps) {
  Trajectory t;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = model->loss(model->forward(ids), targets);
    loss.backward();
    t.losses.push_back(loss.detach().clone());
    std::map<std::string, at::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    t.grads.push_back(g);
    opt.step();
    std::map<std::string, at::Tensor> w;
    for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().clone();
    t.weights.push_back(w);
  }
  return t;
}

struct GptCase {
  int tp;
  bool sp;
  bool tied = true;
  double dropout = 0;
};

// With dropout: each model draws its masks from a generator of its own (the ranks are threads of
// one process, which share the default one), every one seeded alike, as the trainer seeds a
// tensor-parallel group's processes (Note [Coordinated dropout] in src/models/gpt.cpp).
void seed_dropout(GPT& model, double dropout) {
  if (dropout > 0) model->set_dropout_generator(at::make_generator<at::CPUGeneratorImpl>(11));
}

class GptTransparency : public ::testing::TestWithParam<GptCase> {};

TEST_P(GptTransparency, LossGradientsAndWeightsEqualTheSingleProcessAtEveryStep) {
  const auto [n, sp, tied, dropout] = GetParam();
  const int steps = 3;
  GPT whole(small_gpt(tied, dropout));
  whole->to(at::kDouble);
  seed_dropout(whole, dropout);
  GPT start(small_gpt(tied));
  start->to(at::kDouble);
  copy_state(*start, *whole);
  auto ids = at::randint(0, 16, {2, 8}, at::kLong);
  auto targets = at::randint(0, 16, {2, 8}, at::kLong);
  targets[0][3] = -100;  // an ignored token
  const Trajectory want = whole_run(whole, ids, targets, steps);
  if (dropout > 0) {  // the masks are drawn: the gradients are not the model's without dropout
    GPT plain(small_gpt(tied));
    plain->to(at::kDouble);
    copy_state(*plain, *start);
    plain->loss(plain->forward(ids), targets).backward();
    const auto& g = plain->named_parameters()["transformer.h.0.mlp.c_fc.weight"].grad();
    const auto& with = want.grads[0].at("transformer.h.0.mlp.c_fc.weight");
    EXPECT_GT((with - g).abs().max().item<double>(), 0.1 * g.abs().max().item<double>());
  }
  auto errors = testing::run_ranks(n, [&](Dist& d) {
    GPT m(small_gpt(tied, dropout));
    m->to(at::kDouble);
    copy_state(*m, *start);
    m->parallelize(d, sp);
    seed_dropout(m, dropout);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.5));
    for (int s = 0; s < steps; ++s) {
      const std::string step = "step " + std::to_string(s + 1) + ": ";
      opt.zero_grad();
      auto loss = m->loss(m->forward(ids), targets);
      expect_close(loss.detach(), want.losses[s], step + "loss");
      loss.backward();  // with sequence parallelism the plan sums the replicated gradients
      auto grads = gather_full_state(*m, d, true);
      for (const auto& [name, g] : want.grads[s]) {
        expect_close(grads.at(name), g, step + name + "'s gradient");
      }
      opt.step();
      auto w = gather_full_state(*m, d);
      for (const auto& [name, v] : want.weights[s]) expect_close(w.at(name), v, step + name);
    }
  });
  EXPECT_EQ(errors, no_errors(n));
}

INSTANTIATE_TEST_SUITE_P(
    Degrees, GptTransparency,
    ::testing::Values(GptCase{1, false}, GptCase{2, false}, GptCase{4, false}, GptCase{2, true},
                      GptCase{4, true}, GptCase{2, false, false}, GptCase{4, true, false},
                      // Coordinated dropout (Note [Coordinated dropout])
                      GptCase{2, false, true, 0.2}, GptCase{4, true, false, 0.2}),
    [](const auto& c) {
      return "tp" + std::to_string(c.param.tp) + (c.param.sp ? "_sequence_parallel" : "") +
             (c.param.tied ? "" : "_untied_head") + (c.param.dropout > 0 ? "_dropout" : "");
    });

// 2D: DistributedDataParallel over the mesh's dp dimension, the GPT split over its tp dimension
// (mesh {dp: 2, tp: 2} on 4 ranks): each replica trains on half the batch, and the gradients are
// the whole model's on the whole batch (every token counted: no ignored target here, so that
// the two halves' means weigh alike).
TEST(TensorParallel, DataParallelTimesTensorParallelEqualsTheSingleProcess) {
  GPT whole(small_gpt());
  whole->to(at::kDouble);
  GPT start(small_gpt());
  start->to(at::kDouble);
  copy_state(*start, *whole);
  auto ids = at::randint(0, 16, {4, 8}, at::kLong);
  auto targets = at::randint(0, 16, {4, 8}, at::kLong);
  const Trajectory want = whole_run(whole, ids, targets, 2);
  for (bool sp : {false, true}) {
    auto errors = testing::run_ranks(4, [&](Dist& d) {
      const DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, 4);
      auto groups = mesh_groups(d, mesh, "dp_tp");
      const int replica = mesh.coordinates(d.rank()).at(0);
      GPT m(small_gpt());
      m->to(at::kDouble);
      copy_state(*m, *start);
      m->parallelize(groups.at("tp"), sp);
      DistributedDataParallel ddp(m, groups.at("dp"));
      torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.5));
      auto x = ids.narrow(0, 2 * replica, 2);
      auto y = targets.narrow(0, 2 * replica, 2);
      for (int s = 0; s < 2; ++s) {
        const std::string step = "step " + std::to_string(s + 1) + ": ";
        opt.zero_grad();
        auto loss = m->loss(ddp(x), y);
        loss.backward();
        auto grads = gather_full_state(*m, groups.at("tp"), true);
        for (const auto& [name, g] : want.grads[s]) {
          expect_close(grads.at(name), g, step + name + "'s gradient");
        }
        opt.step();
        auto w = gather_full_state(*m, groups.at("tp"));
        for (const auto& [name, v] : want.weights[s]) expect_close(w.at(name), v, step + name);
      }
    });
    EXPECT_EQ(errors, no_errors(4)) << (sp ? "with" : "without") << " sequence parallelism";
  }
}

// 2D with sharded data parallelism: ZeRO stages 1 and 2 over dp (the optimizer state and
// gradients of each tensor-parallel slice sharded over its replicas), and stage 3 (FSDP × TP: the
// slices themselves sharded, each block's gathered over dp for its forward and backward), the
// GPT (untied: FSDP's units cannot share a weight) split over tp. The weights after every step
// are the single process's.
TEST(TensorParallel, ShardedDataParallelTimesTensorParallelEqualsTheSingleProcess) {
  GPT whole(small_gpt(false));
  whole->to(at::kDouble);
  GPT start(small_gpt(false));
  start->to(at::kDouble);
  copy_state(*start, *whole);
  auto ids = at::randint(0, 16, {4, 8}, at::kLong);
  auto targets = at::randint(0, 16, {4, 8}, at::kLong);
  const Trajectory want = whole_run(whole, ids, targets, 2);
  for (int stage : {1, 2, 3}) {
    auto errors = testing::run_ranks(4, [&](Dist& d) {
      const DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, 4);
      auto groups = mesh_groups(d, mesh, "zero_tp");
      const int replica = mesh.coordinate(d.rank(), "dp");
      GPT m(small_gpt(false));
      m->to(at::kDouble);
      copy_state(*m, *start);
      m->parallelize(groups.at("tp"), false);
      ShardOptions so;
      so.stage = stage;
      so.unit_cap_mb = 0.001;  // a unit per block (stage 3 gathers them one by one)
      // Stage 3 (FSDP) gathers the model unit by unit: it takes the model as its chain.
      auto zero = stage == 3
                      ? std::make_unique<ShardedDataParallel>(m->blocks(), groups.at("dp"), so)
                      : std::make_unique<ShardedDataParallel>(m, groups.at("dp"), so);
      torch::optim::SGD opt(zero->parameters(), torch::optim::SGDOptions(0.5));
      auto x = ids.narrow(0, 2 * replica, 2);
      auto y = targets.narrow(0, 2 * replica, 2);
      for (int s = 0; s < 2; ++s) {
        opt.zero_grad();
        auto out = stage == 3 ? zero->forward(x) : zero->forward([&] { return m->forward(x); });
        auto loss = m->loss(out, y);
        loss.backward();
        zero->step(opt);
        zero->gather_full_parameters();  // stage 3: the module's parameters are the units' again
        auto w = gather_full_state(*m, groups.at("tp"));
        for (const auto& [name, v] : want.weights[s]) {
          expect_close(w.at(name), v, "step " + std::to_string(s + 1) + ": " + name);
        }
      }
    });
    EXPECT_EQ(errors, no_errors(4)) << "ZeRO stage " << stage;
  }
}

// 3D: a pipeline of two stages across ranks, each stage split over tp, and with 8 ranks two such
// pipelines in data parallel (DDP per stage over dp): mesh {dp, pp: 2, tp: 2}. The untied GPT's
// chain is cut after its first block; the loss is the vocabulary-parallel one on the last stage.
// Each stage's gradients and the loss equal the single process's on the whole batch.
struct MeshCase {
  int dp;
  PipelineSchedule schedule;
};
class ThreeDimensions : public ::testing::TestWithParam<MeshCase> {};

TEST_P(ThreeDimensions, PipelineTimesTensorParallelEqualsTheSingleProcess) {
  const auto [dp, schedule] = GetParam();
  GPT whole(small_gpt(false));
  whole->to(at::kDouble);
  GPT start(small_gpt(false));
  start->to(at::kDouble);
  copy_state(*start, *whole);
  auto ids = at::randint(0, 16, {4 * dp, 8}, at::kLong);
  auto targets = at::randint(0, 16, {4 * dp, 8}, at::kLong);
  const Trajectory want = whole_run(whole, ids, targets, 1);
  const int world = dp * 4;
  auto errors = testing::run_ranks(world, [&](Dist& d) {
    const DeviceMesh mesh({{"dp", dp}, {"pp", 2}, {"tp", 2}}, world);
    auto groups = mesh_groups(d, mesh, "dp_pp_tp", {"dp", "tp"});
    const int replica = mesh.coordinate(d.rank(), "dp");
    const int stage = mesh.coordinate(d.rank(), "pp");
    GPT m(small_gpt(false));
    m->to(at::kDouble);
    copy_state(*m, *start);
    m->parallelize(groups.at("tp"), false);
    auto chain = m->blocks();  // embed, h0, h1, head
    auto mine = stage == 0 ? slice(chain, 0, 2) : slice(chain, 2, 4);
    std::unique_ptr<DistributedDataParallel> ddp;
    if (dp > 1) ddp = std::make_unique<DistributedDataParallel>(mine, groups.at("dp"));
    DistPipelineOptions o;
    o.stage_ranks = mesh.group(d.rank(), "pp");
    o.chunks = 2;
    o.schedule = schedule;
    o.ddp = ddp.get();
    DistPipeline pipe(mine, o, d);
    auto x = ids.narrow(0, 4 * replica, 4);
    auto y = targets.narrow(0, 4 * replica, 4);
    auto loss = pipe.train_step(
        stage == 0 ? x : at::Tensor(), stage == 1 ? y : at::Tensor(),
        [&](const at::Tensor& out, const at::Tensor& t) { return m->loss(out, t); });
    if (stage == 1 && dp == 1) expect_close(loss.detach(), want.losses[0], "loss");
    std::set<std::string> held;
    for (const auto& p : m->named_parameters()) {
      if (p.value().grad().defined()) held.insert(p.key());
    }
    auto grads = gather_full_state(*m, groups.at("tp"), true);
    ASSERT_FALSE(held.empty());
    for (const auto& name : held) {
      expect_close(grads.at(name), want.grads[0].at(name),
                   "stage " + std::to_string(stage) + ": " + name + "'s gradient");
    }
  });
  EXPECT_EQ(errors, no_errors(world));
}

INSTANTIATE_TEST_SUITE_P(Meshes, ThreeDimensions,
                         ::testing::Values(MeshCase{1, PipelineSchedule::kGPipe},
                                           MeshCase{1, PipelineSchedule::k1F1B},
                                           MeshCase{2, PipelineSchedule::k1F1B}),
                         [](const auto& c) {
                           return "dp" + std::to_string(c.param.dp) + "_pp2_tp2_" +
                                  (c.param.schedule == PipelineSchedule::kGPipe ? "gpipe" : "1f1b");
                         });

// Model state per rank (fp32 parameters, gradients and Adam's two moments: 16 bytes a parameter)
// follows the formulas, measured from the live storages after a step: at tp t, 16 (Ψs/t + Ψr),
// where Ψs counts the whole model's split parameters and Ψr the replicated ones (LayerNorms,
// rowwise biases, position embeddings), each rank's slices 1/t of the first; and under FSDP
// over dp d besides (2D, stage 3), 16 (Ψs/t + Ψr)/d, its units padded to a multiple of d.
TEST(TensorParallel, ModelStatePerRankFollowsTheFormulas) {
  GPTConfig c = small_gpt(false);
  c.n_embd = 64;
  c.vocab_size = 64;
  GPT whole(c);
  const double psi = static_cast<double>(parameter_count(*whole));
  const auto ids = at::randint(0, 64, {2, 8}, at::kLong);  // every rank's batch
  for (const auto& [tp, dp] : std::vector<std::pair<int, int>>{{2, 1}, {4, 1}, {2, 2}}) {
    const int world = tp * dp;
    std::vector<ShardMemory> got(static_cast<size_t>(world));
    double replicated = 0;
    auto errors = testing::run_ranks(world, [&](Dist& d) {
      const DeviceMesh mesh({{"dp", dp}, {"tp", tp}}, world);
      auto groups = mesh_groups(d, mesh, "state");
      GPT m(c);
      copy_state(*m, *whole);
      m->parallelize(groups.at("tp"), false);
      if (d.rank() == 0) {
        for (const auto& p : replicated_parameters(*m)) replicated += p.numel();
      }
      if (dp == 1) {
        torch::optim::Adam opt(m->parameters(), 1e-3);
        m->loss(m->forward(ids), ids).backward();
        opt.step();
        got[static_cast<size_t>(d.rank())] = model_state_memory(*m, &opt);
      } else {
        ShardOptions so;
        so.stage = 3;
        ShardedDataParallel zero(m->blocks(), groups.at("dp"), so);
        torch::optim::Adam opt(zero.parameters(), 1e-3);
        m->loss(zero.forward(ids), ids).backward();
        zero.step(opt);
        got[static_cast<size_t>(d.rank())] = zero.memory(&opt);
      }
    });
    ASSERT_EQ(errors, no_errors(world));
    ASSERT_GT(replicated, 0);
    const double per_rank = 16 * ((psi - replicated) / tp + replicated) / dp;
    for (int r = 0; r < world; ++r) {
      const auto& m = got[static_cast<size_t>(r)];
      const std::string where =
          "tp " + std::to_string(tp) + ", dp " + std::to_string(dp) + ", rank " + std::to_string(r);
      if (dp == 1) {
        EXPECT_EQ(static_cast<double>(m.total()), per_rank) << where;
      } else {  // each of the 4 units (embed, 2 blocks, head) padded by at most dp − 1
        EXPECT_GE(static_cast<double>(m.total()), per_rank) << where;
        EXPECT_LE(static_cast<double>(m.total()), per_rank + 16.0 * 4 * (dp - 1)) << where;
      }
    }
  }
}

// Saved at one degree, loaded at another: the gathered state is the model's whole state, bit for
// bit, and a model split at tp 4 from the state gathered at tp 2 gives the same whole state again.
TEST(TensorParallel, StateGatheredAtOneDegreeSplitsAtAnother) {
  GPT whole(small_gpt());
  std::map<std::string, at::Tensor> at2;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    GPT m(small_gpt());
    copy_state(*m, *whole);
    m->parallelize(d, false);
    auto s = gather_full_state(*m, d);
    if (d.rank() == 0) at2 = s;
  });
  ASSERT_EQ(errors, no_errors(2));
  for (const auto& p : whole->named_parameters()) {
    ASSERT_TRUE(at2.count(p.key())) << p.key();
    EXPECT_TRUE(at::equal(at2.at(p.key()), p.value())) << p.key();
  }
  errors = testing::run_ranks(4, [&](Dist& d) {
    GPT m(small_gpt());
    {
      torch::NoGradGuard no_grad;
      for (auto& p : m->named_parameters()) p.value().copy_(at2.at(p.key()));
    }
    m->parallelize(d, true);
    auto s = gather_full_state(*m, d);
    for (const auto& [name, v] : at2) EXPECT_TRUE(at::equal(s.at(name), v)) << name;
  });
  EXPECT_EQ(errors, no_errors(4));
}

// The zoo's GPT: its chain of blocks computes its forward with its own parameters; a tied head
// has no chain.
TEST(Gpt, ZooModelAndItsChain) {
  ModelOptions o;
  o.vocab_size = 32;
  o.context = 16;
  Model m = make_model("gpt-tiny", o);
  auto ids = at::randint(0, 32, {2, 16}, at::kLong);
  auto out = m.forward(ids);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2, 16, 32}));
  auto chain = as_sequential(m);
  EXPECT_EQ(chain->size(), 4u);  // embed, h0, h1, head
  EXPECT_TRUE(at::equal(chain->forward(ids), out));
  EXPECT_NO_THROW(check_chain(*m.module, chain, m.forward, ids));
  EXPECT_THROW(m.forward(at::randint(0, 32, {2, 17}, at::kLong)), UsageError);  // past context
  GPT tied(small_gpt(true));
  EXPECT_THROW(tied->blocks(), UsageError);
}

TEST(TensorParallel, GptThatDoesNotSplitIsNamed) {
  auto errors = testing::run_ranks(3, [&](Dist& d) {
    GPT m(small_gpt());
    try {
      m->parallelize(d, false);
      ADD_FAILURE() << "4 heads split over 3 ranks";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("4 heads do not split over 3"), std::string::npos)
          << e.what();
    }
  });
  EXPECT_EQ(errors, no_errors(3));
  EXPECT_THROW(gpt_config("gpt-huge"), UsageError);
  EXPECT_EQ(gpt_config("gpt2-small").n_embd, 768);
}

}  // namespace
}  // namespace scaletrain
