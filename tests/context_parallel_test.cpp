// Context parallelism's ring attention (context_parallel.h) against attention over the whole
// sequence on one rank: the outputs and the gradients of q, k and v of every rank's slice, at
// degrees 2 and 4, causal and not, load-balanced and not, with grouped-query heads, with attention
// dropout (the whole sequence's masks); the messages
// each call sends; the split's positions against tables written by hand; and bad input.
//
// Note [Ring attention tolerance]: float64 on both sides. The ring computes each row's softmax
// from N partial log-sum-exps merged in another order than one softmax over the whole row: the
// same sums of products grouped otherwise, each off from the exact value by at most
// gamma(K)·Σ|terms| with K ≤ S·D + S ≈ 600 terms and u = 2^-53, about 1e-13 of the inputs' scale.
// The tests allow 1e-9 of each tensor's largest entry; a block left out, merged twice or masked
// by the wrong positions is off by 1e-2 of it or more.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "scaletrain/context_parallel.h"
#include "scaletrain/error.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

constexpr double kRingTolerance = 1e-9;  // Note [Ring attention tolerance]

struct RingCase {
  int degree;
  bool causal;
  bool balanced;
  int64_t heads = 4, kv_heads = 4;
  bool fused = true;   // RingAttentionOptions::fused: the CPU's flash attention, or the products
  double dropout = 0;  // attention dropout, its mask from a generator seeded kDropoutSeed
};

constexpr uint64_t kDropoutSeed = 29;
at::Generator dropout_generator() { return at::make_generator<at::CPUGeneratorImpl>(kDropoutSeed); }

struct Whole {
  at::Tensor q, k, v, weight;  // inputs, and the weights of the loss sum(out * weight)
  at::Tensor out, dq, dk, dv;  // attention over the whole sequence and its gradients
};

// Attention over the whole sequence, written out (causal by position), and its gradients.
// `bf16_inputs`: the inputs rounded to bfloat16 first (still computed in float64).
Whole whole_attention(const RingCase& c, int64_t length, bool bf16_inputs = false) {
  at::manual_seed(17);
  const int64_t batch = 2, dim = 8;
  const auto f64 = at::TensorOptions(at::kDouble);
  Whole w;
  auto input = [&](int64_t heads) {
    at::Tensor t = at::randn({batch, heads, length, dim}, f64);
    return (bf16_inputs ? t.to(at::kBFloat16).to(at::kDouble) : t).requires_grad_();
  };
  w.q = input(c.heads);
  w.k = input(c.kv_heads);
  w.v = input(c.kv_heads);
  w.weight = at::randn({batch, c.heads, length, dim}, f64);
  const int64_t group = c.heads / c.kv_heads;
  const at::Tensor k = w.k.repeat_interleave(group, 1), v = w.v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(w.q, k.transpose(-2, -1)) / std::sqrt(double(dim));
  if (c.causal) {
    s = s.masked_fill(at::ones({length, length}, at::kBool).triu(1),
                      -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(s, -1);
  if (c.dropout > 0) {  // the whole probabilities' mask, kept ones scaled by 1 / (1 - p)
    const at::Tensor mask =
        at::empty(probs.sizes(), f64).bernoulli_(1 - c.dropout, dropout_generator());
    probs = probs * mask / (1 - c.dropout);
  }
  w.out = at::matmul(probs, v);
  (w.out * w.weight).sum().backward();
  w.dq = w.q.grad();
  w.dk = w.k.grad();
  w.dv = w.v.grad();
  w.out = w.out.detach();
  return w;
}

::testing::AssertionResult close_to(const at::Tensor& got, const at::Tensor& want,
                                    const std::string& what) {
  const double scale = want.abs().max().item<double>();
  const double diff = (got - want).abs().max().item<double>();
  if (got.sizes() == want.sizes() && diff <= kRingTolerance * scale) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << what << ": shapes " << got.sizes() << " and " << want.sizes() << ", largest difference "
         << diff << " against largest entry " << scale;
}

// Every rank's slice through ring_attention, checked against the whole; returns the errors.
std::vector<std::string> ring_against_whole(const RingCase& c, int64_t length,
                                            RingTraffic* traffic) {
  const Whole w = whole_attention(c, length);
  std::vector<std::string> mismatches(static_cast<size_t>(c.degree));
  auto errors = testing::run_ranks(c.degree, [&](Dist& d) {
    const ContextSplit split{d.size(), d.rank(), c.balanced};
    auto mine = [&](const at::Tensor& t) { return split.shard(t.detach(), 2); };
    const at::Tensor q = mine(w.q).requires_grad_(), k = mine(w.k).requires_grad_(),
                     v = mine(w.v).requires_grad_();
    RingAttentionOptions o;
    o.causal = c.causal;
    o.traffic = traffic;
    o.fused = c.fused;
    o.dropout = {c.dropout, {}, dropout_generator()};  // every rank's in the same state
    const at::Tensor out = ring_attention(q, k, v, d, split, o);
    (out * mine(w.weight)).sum().backward();
    std::string& bad = mismatches[static_cast<size_t>(d.rank())];
    for (const auto& [name, got, want] :
         std::vector<std::tuple<std::string, at::Tensor, at::Tensor>>{
             {"output", out.detach(), w.out},
             {"dq", q.grad(), w.dq},
             {"dk", k.grad(), w.dk},
             {"dv", v.grad(), w.dv}}) {
      const auto r = close_to(got, mine(want), name);
      if (!r) bad += std::string(r.message()) + "; ";
    }
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty() && !mismatches[r].empty()) errors[r] = mismatches[r];
  }
  return errors;
}

class RingAttentionCases : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingAttentionCases, FollowsAttentionOverTheWholeSequence) {
  const RingCase c = GetParam();
  const int64_t length = 8 * c.degree;
  RingTraffic traffic;
  const auto errors = ring_against_whole(c, length, &traffic);
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  // A ring of N: N − 1 hops of keys and values forward on each rank; backward, N − 1 again and
  // N of their gradients.
  const int64_t n = c.degree;
  EXPECT_EQ(traffic.forward_messages.load(), n * (n - 1));
  EXPECT_EQ(traffic.backward_messages.load(), n * (n - 1) + n * n);
  const int64_t block = 2 * 2 * c.kv_heads * (length / n) * 8 * int64_t(sizeof(double));
  EXPECT_EQ(traffic.bytes.load(), (n * (n - 1) * 2 + n * n) * block);
}

INSTANTIATE_TEST_SUITE_P(
    RingAttention, RingAttentionCases,
    ::testing::Values(RingCase{2, true, true}, RingCase{2, true, false}, RingCase{2, false, true},
                      RingCase{4, true, true}, RingCase{4, true, false}, RingCase{4, false, false},
                      RingCase{2, true, true, 4, 2}, RingCase{4, true, true, 4, 1},
                      RingCase{2, true, true, 4, 4, false}, RingCase{4, true, false, 4, 2, false},
                      RingCase{2, false, true, 4, 4, false},
                      RingCase{2, true, true, 4, 2, true, 0.3},
                      RingCase{4, true, false, 4, 4, true, 0.3},
                      RingCase{2, false, true, 4, 4, true, 0.3}),
    [](const auto& p) {
      const RingCase& c = p.param;
      return "Cp" + std::to_string(c.degree) + (c.causal ? "Causal" : "Full") +
             (c.balanced ? "Balanced" : "InOrder") +
             (c.kv_heads < c.heads ? "Gqa" + std::to_string(c.kv_heads) : "") +
             (c.fused ? "" : "Products") + (c.dropout > 0 ? "Dropout" : "");
    });

TEST(RingAttention, DegreeOneIsPlainAttentionWithoutAGroup) {
  const RingCase c{1, true, true};
  const Whole w = whole_attention(c, 12);
  const at::Tensor q = w.q.detach().requires_grad_(), k = w.k.detach().requires_grad_(),
                   v = w.v.detach().requires_grad_();
  RingTraffic traffic;
  RingAttentionOptions o;
  o.traffic = &traffic;
  const at::Tensor out = ring_attention(q, k, v, Dist{}, ContextSplit{}, o);
  (out * w.weight).sum().backward();
  EXPECT_TRUE(close_to(out.detach(), w.out, "output"));
  EXPECT_TRUE(close_to(q.grad(), w.dq, "dq"));
  EXPECT_TRUE(close_to(k.grad(), w.dk, "dk"));
  EXPECT_TRUE(close_to(v.grad(), w.dv, "dv"));
  EXPECT_EQ(traffic.forward_messages.load() + traffic.backward_messages.load(), 0);
}

// Off (one rank, no ring), ContextParallelism::attention with dropout is the three products with
// the probabilities' mask drawn over them; the ring at degree 1 draws the same one.
TEST(RingAttention, DropoutAtDegreeOneDrawsTheSameMasks) {
  const RingCase c{1, true, true, 4, 2, true, 0.25};
  const Whole w = whole_attention(c, 12);
  const AttentionDropout drop{c.dropout, {}, dropout_generator()};
  for (bool ring : {false, true}) {
    SCOPED_TRACE(ring ? "ring at degree 1" : "ContextParallelism off");
    const at::Tensor q = w.q.detach().requires_grad_(), k = w.k.detach().requires_grad_(),
                     v = w.v.detach().requires_grad_();
    RingAttentionOptions o;
    o.dropout = {c.dropout, {}, dropout_generator()};
    const at::Tensor out = ring ? ring_attention(q, k, v, Dist{}, ContextSplit{}, o)
                                : ContextParallelism{}.attention(q, k, v, std::nullopt, drop);
    (out * w.weight).sum().backward();
    EXPECT_TRUE(close_to(out.detach(), w.out, "output"));
    EXPECT_TRUE(close_to(q.grad(), w.dq, "dq"));
    EXPECT_TRUE(close_to(k.grad(), w.dk, "dk"));
    EXPECT_TRUE(close_to(v.grad(), w.dv, "dv"));
  }
}

// bfloat16 inputs: the scores, statistics and gradients in float32, the result in bf16. Against
// the float64 whole on the same bf16 values: each output is a convex combination of values, so
// the result's rounding to bf16 errs by at most 2^-8 of max|v|, and float32's sums by
// gamma(S·D)·max|v| (below 1e-4 of it) besides.
TEST(RingAttention, Bfloat16InputsComputeInFloat32) {
  const RingCase c{2, true, true};
  const Whole w = whole_attention(c, 16, /*bf16_inputs=*/true);
  const double bound = (std::ldexp(1.0, -8) + 1e-4) * w.v.abs().max().item<double>();
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    const ContextSplit split{d.size(), d.rank()};
    auto mine = [&](const at::Tensor& t) { return split.shard(t.detach(), 2); };
    const at::Tensor out = ring_attention(mine(w.q).to(at::kBFloat16), mine(w.k).to(at::kBFloat16),
                                          mine(w.v).to(at::kBFloat16), d, split);
    if (out.scalar_type() != at::kBFloat16) throw Error("the output is not bf16");
    const double diff = (out.to(at::kDouble) - mine(w.out)).abs().max().item<double>();
    if (diff > bound) {
      throw Error("bf16 output off by " + std::to_string(diff) + " > " + std::to_string(bound));
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(ContextSplit, PositionsAgainstHandTables) {
  auto list = [](const at::Tensor& t) {
    std::vector<int64_t> out(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    return out;
  };
  using V = std::vector<int64_t>;
  // Balanced, 2 ranks, 8 tokens: 4 chunks of 2; rank 0 the first and last, rank 1 the middle.
  EXPECT_EQ(list(ContextSplit{2, 0}.positions(8)), (V{0, 1, 6, 7}));
  EXPECT_EQ(list(ContextSplit{2, 1}.positions(8)), (V{2, 3, 4, 5}));
  // Balanced, 4 ranks, 8 tokens: 8 chunks of 1.
  EXPECT_EQ(list(ContextSplit{4, 0}.positions(8)), (V{0, 7}));
  EXPECT_EQ(list(ContextSplit{4, 2}.positions(8)), (V{2, 5}));
  EXPECT_EQ(list(ContextSplit{4, 3}.positions(8)), (V{3, 4}));
  // In order.
  EXPECT_EQ(list(ContextSplit{2, 1, false}.positions(6)), (V{3, 4, 5}));
  EXPECT_EQ(list(ContextSplit{1, 0}.positions(3)), (V{0, 1, 2}));
  // shard() keeps the same tokens in the same order.
  const at::Tensor ids = at::arange(100, 108, at::kLong).unsqueeze(0);
  EXPECT_EQ(list(ContextSplit{2, 0}.shard(ids, 1)), (V{100, 101, 106, 107}));
  EXPECT_EQ(list(ContextSplit{4, 1, false}.shard(ids, -1)), (V{102, 103}));
}

// Causal balance: every rank attends to the same number of (query, key) pairs.
TEST(ContextSplit, BalancedRanksSeeEqualWork) {
  for (int n : {2, 4, 8}) {
    const int64_t length = 4 * n;
    std::vector<int64_t> balanced, in_order;
    for (int r = 0; r < n; ++r) {
      for (bool b : {true, false}) {
        const at::Tensor p = ContextSplit{n, r, b}.positions(length);
        (b ? balanced : in_order).push_back((p + 1).sum().item<int64_t>());  // keys ≤ position
      }
    }
    for (int r = 1; r < n; ++r) EXPECT_EQ(balanced[size_t(r)], balanced[0]) << n << " ranks";
    EXPECT_LT(in_order.front(), in_order.back()) << n << " ranks";
  }
}

TEST(ContextSplit, BadInputNamesTheValueAndTheFix) {
  try {
    ContextSplit{4, 1}.positions(12);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("12 tokens"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 8"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ContextSplit({2, 2}).check(8), UsageError);
  const auto q = at::zeros({1, 3, 4, 2}), k = at::zeros({1, 2, 4, 2});
  try {
    ring_attention(q, k, k, Dist{}, ContextSplit{});
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("2 key/value heads do not divide 3"), std::string::npos)
        << e.what();
  }
  try {
    ring_attention(q, q, q, Dist{}, ContextSplit{2, 0});
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace scaletrain
