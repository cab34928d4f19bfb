// Expert parallelism (expert_parallel.h): dispatch then combine with equal weights is the
// identity, forward and backward, at ep 1, 2 and 4; a MoE layer under ep 2 and ep 4 follows the
// same layer on one rank over all the tokens (outputs, and the gradients of the router and of
// every expert); experts that receive no token, every token to one expert, a single expert; the
// load-balancing loss's gradient; the messages per layer; bad input.
//
// Note [Expert parallelism tolerance]: float64 on both sides. A token's output is the same sum
// of the same products at every ep degree (its k slots are added in expert order, Note [Token
// dispatch]); what may differ is the blocking of each expert's matmul over a different number of
// rows, and the order in which an expert's weight gradient sums its rows (each a dot product of
// at most K = rows ≤ 64 terms): at most gamma(K)·Σ|terms|, about 1e-14 of the entries' scale
// with u = 2^-53. The tests allow 1e-10 of each tensor's largest entry; a token sent to the wrong
// expert or rank, or an expert's gradient from one rank's tokens only, is off by 1e-2 or more.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"
#include "scaletrain/mesh.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

constexpr double kExpertTolerance = 1e-10;  // Note [Expert parallelism tolerance]

std::string differs(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const double scale = want.abs().max().item<double>();
  if (got.sizes() != want.sizes()) return what + ": another shape; ";
  const double diff = (got - want).abs().max().item<double>();
  if (diff <= kExpertTolerance * std::max(scale, 1e-300)) return "";
  return what + ": off by " + std::to_string(diff) + " of " + std::to_string(scale) + "; ";
}

at::Tensor rows_of(const at::Tensor& t, int rank, int n) {
  const int64_t per = t.size(0) / n;
  return t.narrow(0, rank * per, per);
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Routes chosen by hand: `ids` [T, k] for the whole batch, cut over the ranks by rows.
void identity_through(int n, const at::Tensor& x, const at::Tensor& ids, int64_t experts) {
  const int64_t k = ids.size(1);
  const at::Tensor g = at::randn(x.sizes(), x.options());
  auto body = [&](const Dist* ep, int rank) -> std::string {
    const at::Tensor mine = rows_of(x, rank, n).clone().requires_grad_();
    const Dispatched d = dispatch(mine, rows_of(ids, rank, n), experts, ep);
    const at::Tensor w = at::full({mine.size(0), k}, 1.0 / double(k), x.options());
    const at::Tensor out = combine(d.rows, d, w);
    (out * rows_of(g, rank, n)).sum().backward();
    return differs(out, mine.detach(), "combine(dispatch(x))") +
           differs(mine.grad(), rows_of(g, rank, n), "its gradient");
  };
  if (n == 1) {
    EXPECT_EQ(body(nullptr, 0), "");
    return;
  }
  std::vector<std::string> bad(static_cast<size_t>(n));
  auto errors = testing::run_ranks(n, [&](Dist& d) { bad[size_t(d.rank())] = body(&d, d.rank()); });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r] + bad[r], "") << "rank " << r;
}

TEST(TokenDispatch, CombineOfDispatchIsTheIdentityForwardAndBackward) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({16, 6}, at::kDouble);
  for (int n : {1, 2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(n));
    identity_through(
        n, x,
        at::stack({at::randperm(8, at::kLong).repeat(2), at::randint(0, 8, {16}, at::kLong)}, 1),
        8);
  }
}

TEST(TokenDispatch, ExpertsWithNoTokenAndEveryTokenToOneExpert) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({8, 4}, at::kDouble);
  for (int n : {1, 2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(n));
    identity_through(n, x, at::full({8, 1}, 5, at::kLong), 8);  // all to expert 5
    identity_through(n, x,
                     at::full({8, 2}, 0, at::kLong).index_fill_(1, at::tensor({int64_t{1}}), 7), 8);
  }
  identity_through(1, x, at::zeros({8, 1}, at::kLong), 1);  // a single expert
}

TEST(TokenDispatch, RanksSeeTheirExpertsRowsInGlobalOrder) {
  // 2 ranks, 4 experts (2 each), one token per (rank, expert): rank 1's expert 2 gets rank 0's
  // token 2 then rank 1's token 2.
  const at::Tensor x = at::arange(8, at::kDouble).unsqueeze(1);
  const at::Tensor ids = at::tensor({0, 1, 2, 3, 0, 1, 2, 3}, at::kLong).unsqueeze(1);
  std::vector<std::vector<int64_t>> counts(2);
  std::vector<at::Tensor> rows(2);
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    const Dispatched got = dispatch(rows_of(x, d.rank(), 2), rows_of(ids, d.rank(), 2), 4, &d);
    counts[size_t(d.rank())] = got.rows_per_expert;
    rows[size_t(d.rank())] = got.rows.squeeze(1);
  });
  expect_no_errors(errors);
  EXPECT_EQ(counts[0], (std::vector<int64_t>{2, 2}));
  EXPECT_TRUE(at::equal(rows[0], at::tensor({0., 4., 1., 5.}, at::kDouble)));
  EXPECT_TRUE(at::equal(rows[1], at::tensor({2., 6., 3., 7.}, at::kDouble)));
}

// ep ranks hold the experts E / ep each; with edp > 1 each of them is edp ranks that share the
// E / ep experts (MoEImpl::shard_experts), E / (ep · edp) held each: ep · edp ranks in all, on
// the mesh {edp, ep}.
struct MoECase {
  int ep;
  int64_t experts, top_k;
  bool swiglu;
  int edp = 1;
};

class MoECases : public ::testing::TestWithParam<MoECase> {};

TEST_P(MoECases, FollowsOneRankOverAllTheTokens) {
  const MoECase c = GetParam();
  MoEOptions o(8, 12, c.experts);
  o.top_k = c.top_k;
  o.swiglu = c.swiglu;
  o.aux_loss_coef = 0;  // each rank's own tokens' loss: the gradient test is below
  at::manual_seed(11);
  MoE whole(o);
  whole->to(at::kDouble);
  const int world = c.ep * c.edp;
  const at::Tensor x = at::randn({4 * world, 3, 8}, at::kDouble);  // [batch, sequence, dim]
  const at::Tensor g = at::randn(x.sizes(), at::kDouble);
  const at::Tensor want = whole->forward(x);
  (want * g).sum().backward();
  std::vector<std::string> bad(static_cast<size_t>(world));
  ExpertTraffic traffic;
  auto errors = testing::run_ranks(world, [&](Dist& d) {
    auto moe = std::dynamic_pointer_cast<MoEImpl>(whole->clone());
    moe->zero_grad();
    moe->traffic = &traffic;
    auto groups = mesh_groups(d, DeviceMesh({{"edp", c.edp}, {"ep", c.ep}}, world));
    moe->expert_parallel(&groups.at("ep"));
    moe->shard_experts(&groups.at("edp"));
    const int64_t held = moe->held_experts();
    const int64_t first = moe->first_expert() + groups.at("edp").rank() * held;
    // The input needs its gradient, as a layer's inside a model does (the rows' way back).
    const at::Tensor out = moe->forward(rows_of(x, d.rank(), world).clone().requires_grad_());
    (out * rows_of(g, d.rank(), world)).sum().backward();
    std::string& b = bad[size_t(d.rank())];
    b += differs(out.detach(), rows_of(want, d.rank(), world).detach(), "output");
    // The router's gradient here is this rank's tokens' share; summed, the whole one.
    at::Tensor router = moe->router.grad().clone();
    d.all_reduce(router);
    b += differs(router, whole->router.grad(), "router gradient (summed over ranks)");
    // Each held expert's gradient is over every rank's tokens (sharded: summed over edp).
    for (const auto& [name, mine, all] :
         {std::tuple{"w1", moe->w1, whole->w1}, std::tuple{"w2", moe->w2, whole->w2}}) {
      b += differs(mine.grad(), all.grad().narrow(0, first, held), std::string(name) + " gradient");
    }
    if (c.swiglu) b += differs(moe->w3.grad(), whole->w3.grad().narrow(0, first, held), "w3");
  });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r] + bad[r], "") << "rank " << r;
  // Per layer and rank: counts, rows out, rows back forward; the two row exchanges backward.
  EXPECT_EQ(traffic.exchanges.load(), c.ep == 1 ? 0 : 5 * world);
  // Sharded: one gather of the experts forward, one reduce-scatter of their gradients backward.
  EXPECT_EQ(traffic.shard_exchanges.load(), c.edp == 1 ? 0 : 2 * world);
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, MoECases,
                         ::testing::Values(MoECase{1, 4, 2, false}, MoECase{2, 4, 2, false},
                                           MoECase{2, 8, 1, true}, MoECase{4, 4, 2, true},
                                           MoECase{4, 8, 3, false}, MoECase{2, 2, 2, false},
                                           MoECase{2, 4, 2, true, 2}, MoECase{1, 4, 1, false, 2}),
                         [](const ::testing::TestParamInfo<MoECase>& p) {
                           const MoECase& c = p.param;
                           return "ep" + std::to_string(c.ep) + "_experts" +
                                  std::to_string(c.experts) + "_top" + std::to_string(c.top_k) +
                                  (c.swiglu ? "_swiglu" : "_gelu") +
                                  (c.edp > 1 ? "_edp" + std::to_string(c.edp) : "");
                         });

TEST(MoE, ASingleExpertIsItsMlp) {
  MoEOptions o(6, 10, 1);
  o.top_k = 1;
  at::manual_seed(5);
  MoE moe(o);
  moe->to(at::kDouble);
  const at::Tensor x = at::randn({5, 6}, at::kDouble);
  const at::Tensor want = at::matmul(at::gelu(at::matmul(x, moe->w1[0])), moe->w2[0]);
  EXPECT_EQ(differs(moe->forward(x).detach(), want.detach(), "one expert"), "");
}

TEST(MoE, LoadBalancingLossEntersTheGradientWithItsCoefficient) {
  MoEOptions o(8, 12, 4);
  o.aux_loss_coef = 0.25;
  at::manual_seed(6);
  MoE with(o);
  with->to(at::kDouble);
  auto without = std::dynamic_pointer_cast<MoEImpl>(with->clone());
  without->options.aux_loss_coef = 0;
  const at::Tensor x = at::randn({10, 8}, at::kDouble), g = at::randn({10, 8}, at::kDouble);
  const at::Tensor out = with->forward(x);
  (out * g).sum().backward();
  // The reference: the loss with 0.25 · aux added, by the same route().
  const at::Tensor ref = without->forward(x);
  ((ref * g).sum() + 0.25 * route(x, without->router, o).aux_loss).backward();
  EXPECT_EQ(differs(out.detach(), ref.detach(), "output (the loss stays the model's)"), "");
  EXPECT_EQ(differs(with->router.grad(), without->router.grad(), "router gradient"), "");
  EXPECT_GT(with->last_aux_loss.item<double>(), 0.0);
  // A balanced router's loss is 1: E · Σ (1/E)(1/E) · E.
  const at::Tensor flat = at::zeros({4, 8}, at::kDouble);
  EXPECT_NEAR(route(x, flat, o).aux_loss.item<double>(), 1.0, 1e-12);
}

TEST(MoE, BadInputNamesTheValueAndTheFix) {
  MoEOptions o(8, 12, 4);
  o.top_k = 5;
  try {
    o.check();
    ADD_FAILURE() << "top_k 5 of 4 experts accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--top-k 5"), std::string::npos) << e.what();
  }
  MoEOptions six(8, 12, 6);
  six.top_k = 2;
  auto errors = testing::run_ranks(4, [&](Dist& d) {
    MoE moe(six);
    moe->expert_parallel(&d);
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("6 experts cannot be spread over --ep 4"), std::string::npos) << e;
  // 6 experts, which 4 edp ranks cannot share.
  auto sharded = testing::run_ranks(4, [&](Dist& d) {
    MoE moe(six);
    moe->shard_experts(&d);
  });
  for (const auto& e : sharded)
    EXPECT_NE(e.find("the 6 experts this rank computes cannot be sharded over 4 ranks"),
              std::string::npos)
        << e;
  EXPECT_THROW(dispatch(at::zeros({2, 3}), at::full({2, 1}, 4, at::kLong), 4, nullptr), UsageError);
  EXPECT_THROW(dispatch(at::zeros({2, 3}), at::zeros({3, 1}, at::kLong), 4, nullptr), UsageError);
}

}  // namespace
}  // namespace scaletrain
