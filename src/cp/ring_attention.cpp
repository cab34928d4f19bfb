// Note [Ring attention]
// ~~~~~~~~~~~~~~~~~~~~~
// Rank r of N holds the queries, keys and values of its tokens (ContextSplit). Step i = 0 … N−1
// it holds the keys and values of rank s = r − i (mod N): the block it computes is its queries
// against them, and the block passes on to rank r + 1 while it computes (the next hop is posted
// before the block's matmuls). Each block gives, for each query row, a partial output o_i
// (softmax-weighted over the block's keys) and the log-sum-exp l_i of its scores; the rows'
// running (o, l) take each block in:
//
//     l' = log(e^l + e^l_i)        o' = o · e^(l − l') + o_i · e^(l_i − l')
//
// which is exact: after the N blocks, o is the softmax over every key, whatever the order.
// Causal, a block is computed on the query rows that see at least one of its keys and on the
// keys that at least one row sees (by the tokens' true positions), masked where needed: no row
// is ever all masked, and a block no row sees costs nothing (it still passes on, so that every
// rank sends and receives the same messages). Rank r's own block comes first, and each of its
// rows sees itself, so the running l is finite from the first step.
//
// Backward recomputes each block from q, k, v and the final l (flash attention's way: nothing
// of size S² is kept between forward and backward): with P = e^(scores − l) and
// D = rowsum(dO ∘ O),
//
//     dV = Pᵀ dO     dS = P ∘ (dO Vᵀ − D)     dQ = dS K · scale     dK = dSᵀ Q · scale
//
// The keys and values go round the ring again, and with them an accumulator of their
// gradients: each rank adds its queries' share and passes it on, and the N-th hop brings a
// block's gradient home. Grouped-query attention exchanges the kv heads only; each is repeated
// for its query heads in the block, and its gradients summed back over them.

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "scaletrain/context_parallel.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kKvTag = 7301, kGradTag = 7302;  // point-to-point tags of the two exchanges

std::string str(int64_t v) { return std::to_string(v); }

// Which part of a block is computed: the query rows that see a key of it and the keys that a
// row sees (all: undefined), and where a pair is hidden within those (undefined: none).
struct BlockPlan {
  bool empty = false;
  at::Tensor rows, cols, hidden;
};

BlockPlan plan_block(const at::Tensor& q_pos, const at::Tensor& k_pos, bool causal,
                     const at::Device& device) {
  BlockPlan plan;
  if (!causal) return plan;
  const at::Tensor seen = k_pos.unsqueeze(0).le(q_pos.unsqueeze(1));  // [Sq, Sk], on the CPU
  const at::Tensor row_sees = seen.any(1), col_seen = seen.any(0);
  const int64_t nrows = row_sees.sum().item<int64_t>(), ncols = col_seen.sum().item<int64_t>();
  if (nrows == 0) {
    plan.empty = true;
    return plan;
  }
  at::Tensor sub = seen;
  if (nrows < seen.size(0)) {
    plan.rows = row_sees.nonzero().flatten();
    sub = sub.index_select(0, plan.rows);
    plan.rows = plan.rows.to(device);
  }
  if (ncols < seen.size(1)) {
    plan.cols = col_seen.nonzero().flatten();
    sub = sub.index_select(1, plan.cols);
    plan.cols = plan.cols.to(device);
  }
  if (!sub.all().item<bool>()) plan.hidden = sub.logical_not().to(device);
  return plan;
}

at::Tensor rows_of(const at::Tensor& t, const at::Tensor& rows) {
  return rows.defined() ? t.index_select(2, rows) : t;
}

// Keys or values of a block for the query heads: the plan's columns, each kv head repeated.
at::Tensor for_heads(const at::Tensor& t, const BlockPlan& plan, int64_t group) {
  at::Tensor out = rows_of(t, plan.cols);
  return group > 1 ? out.repeat_interleave(group, 1) : out;
}

// Gradients of the repeated heads summed back onto their kv head.
at::Tensor to_kv_heads(const at::Tensor& g, int64_t group) {
  if (group == 1) return g;
  const auto s = g.sizes();
  return g.view({s[0], s[1] / group, group, s[2], s[3]}).sum(2);
}

at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const BlockPlan& plan, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (plan.hidden.defined()) s.masked_fill_(plan.hidden, -std::numeric_limits<double>::infinity());
  return s;
}

// The ring as this rank sees it: its group, its split, its peers, and the traffic counters.
struct Ring : torch::CustomClassHolder {
  Dist cp;  // a handle on the caller's group (its backend is shared)
  ContextSplit split;
  RingAttentionOptions options;
  int64_t length = 0;  // the whole sequence
  int next() const { return (split.rank + 1) % split.degree; }
  int prev() const { return (split.rank + split.degree - 1) % split.degree; }
  int source(int step) const { return (split.rank - step + split.degree) % split.degree; }

  // Posts the hop of `block` to the next rank and of the previous rank's into `into`.
  std::vector<Pending> hop(const at::Tensor& block, at::Tensor& into, int tag,
                           bool backward) const {
    if (options.traffic) {
      (backward ? options.traffic->backward_messages : options.traffic->forward_messages) += 1;
      options.traffic->bytes += static_cast<int64_t>(block.nbytes());
    }
    const std::string what = std::string("ring attention's ") +
                             (tag == kKvTag ? "keys and values" : "key and value gradients");
    std::vector<Pending> out;
    out.push_back(cp.isend(block, next(), tag, what + " to rank " + str(next())));
    out.push_back(cp.irecv(into, prev(), tag, what + " from rank " + str(prev())));
    return out;
  }
};

void wait_all(std::vector<Pending>& pending) {
  for (auto& p : pending) p.wait();
  pending.clear();
}

// One block into the rows' running output and log-sum-exp (float32 or float64).
void merge_block(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& kv,
                 const BlockPlan& plan, int64_t group, double scale) {
  const at::Tensor s = scores(rows_of(q, plan.rows), for_heads(kv[0], plan, group), plan, scale);
  const at::Tensor l = at::logsumexp(s, -1);
  const at::Tensor o = at::matmul(at::exp(s - l.unsqueeze(-1)), for_heads(kv[1], plan, group));
  const at::Tensor lo = rows_of(lse, plan.rows), oo = rows_of(out, plan.rows);
  const at::Tensor ln = at::logaddexp(lo, l);
  const at::Tensor on = oo * at::exp(lo - ln).unsqueeze(-1) + o * at::exp(l - ln).unsqueeze(-1);
  if (plan.rows.defined()) {
    lse.index_copy_(2, plan.rows, ln);
    out.index_copy_(2, plan.rows, on);
  } else {
    lse.copy_(ln);
    out.copy_(on);
  }
}

at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::IValue held) {
    const Ring& ring = *static_cast<Ring*>(held.toCapsule().get());
    const auto type = compute_type(q);
    const at::Tensor qf = q.to(type);
    const int64_t group = q.size(1) / k.size(1);
    const double scale = ring.options.scale.value_or(1.0 / std::sqrt(double(q.size(-1))));
    const at::Tensor q_pos = ring.split.positions(ring.length);
    at::Tensor out = at::zeros(qf.sizes(), qf.options());
    at::Tensor lse = at::full({q.size(0), q.size(1), q.size(2)},
                              -std::numeric_limits<double>::infinity(), qf.options());
    at::Tensor block = at::stack({k, v}).contiguous(), next;
    std::vector<Pending> pending;
    for (int i = 0; i < ring.split.degree; ++i) {
      if (i + 1 < ring.split.degree) {
        next = at::empty_like(block);
        pending = ring.hop(block, next, kKvTag, false);
      }
      const auto plan = plan_block(q_pos, ring.split.positions_of(ring.source(i), ring.length),
                                   ring.options.causal, q.device());
      if (!plan.empty) merge_block(out, lse, qf, block.to(type), plan, group, scale);
      if (i + 1 < ring.split.degree) {
        wait_all(pending);
        block = next;
      }
    }
    ctx->saved_data["ring"] = held;
    ctx->save_for_backward({q, k, v, out, lse});
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list g);
};

// Backward of one block: dQ of the rows into `dq`, dK and dV of its keys into `dkv`.
void block_backward(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& d_out,
                    const at::Tensor& lse, const at::Tensor& delta, const BlockPlan& plan,
                    int64_t group, double scale, at::Tensor& dq, at::Tensor& dkv) {
  const at::Tensor qs = rows_of(q, plan.rows), dos = rows_of(d_out, plan.rows);
  const at::Tensor ks = for_heads(kv[0], plan, group), vs = for_heads(kv[1], plan, group);
  const at::Tensor p = at::exp(scores(qs, ks, plan, scale) - rows_of(lse, plan.rows).unsqueeze(-1));
  const at::Tensor dv = to_kv_heads(at::matmul(p.transpose(-2, -1), dos), group);
  const at::Tensor ds =
      p * (at::matmul(dos, vs.transpose(-2, -1)) - rows_of(delta, plan.rows).unsqueeze(-1));
  const at::Tensor dqs = at::matmul(ds, ks).mul_(scale);
  const at::Tensor dk = to_kv_heads(at::matmul(ds.transpose(-2, -1), qs).mul_(scale), group);
  if (plan.rows.defined()) {
    dq.index_add_(2, plan.rows, dqs);
  } else {
    dq.add_(dqs);
  }
  at::Tensor dk_all = dkv[0], dv_all = dkv[1];
  if (plan.cols.defined()) {
    dk_all.index_add_(2, plan.cols, dk);
    dv_all.index_add_(2, plan.cols, dv);
  } else {
    dk_all.add_(dk);
    dv_all.add_(dv);
  }
}

variable_list RingAttention::backward(AutogradContext* ctx, variable_list g) {
  const Ring& ring = *static_cast<Ring*>(ctx->saved_data.at("ring").toCapsule().get());
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
  const auto type = out.scalar_type();
  const at::Tensor qf = q.to(type), d_out = g[0].to(type);
  const int64_t group = q.size(1) / k.size(1);
  const double scale = ring.options.scale.value_or(1.0 / std::sqrt(double(q.size(-1))));
  const at::Tensor q_pos = ring.split.positions(ring.length);
  const at::Tensor delta = (d_out * out).sum(-1);
  at::Tensor dq = at::zeros_like(qf);
  at::Tensor block = at::stack({k, v}).contiguous(), next;
  at::Tensor dkv = at::zeros(block.sizes(), block.options().dtype(type)), dkv_next;
  std::vector<Pending> kv_hop, grad_hop;
  for (int i = 0; i < ring.split.degree; ++i) {
    if (i + 1 < ring.split.degree) {
      next = at::empty_like(block);
      kv_hop = ring.hop(block, next, kKvTag, true);
    }
    const auto plan = plan_block(q_pos, ring.split.positions_of(ring.source(i), ring.length),
                                 ring.options.causal, q.device());
    if (!plan.empty)
      block_backward(qf, block.to(type), d_out, lse, delta, plan, group, scale, dq, dkv);
    if (ring.split.degree > 1) {  // the gradients go on with their block; the N-th hop: home
      dkv_next = at::empty_like(dkv);
      grad_hop = ring.hop(dkv, dkv_next, kGradTag, true);
      wait_all(grad_hop);
      dkv = dkv_next;
    }
    if (i + 1 < ring.split.degree) {
      wait_all(kv_hop);
      block = next;
    }
  }
  return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()),
          at::Tensor()};
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Dist& cp,
                  const ContextSplit& split) {
  const std::string who = "ring_attention: ";
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    throw UsageError(who + "q, k and v must be [batch, heads, sequence slice, head_dim]; got " +
                     c10::str(q.sizes()) + ", " + c10::str(k.sizes()) + ", " + c10::str(v.sizes()));
  }
  if (k.sizes() != v.sizes() || q.size(0) != k.size(0) || q.size(2) != k.size(2) ||
      q.size(3) != k.size(3)) {
    throw UsageError(who +
                     "k and v must match each other, and q in batch, slice length and "
                     "head_dim; got q " +
                     c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " +
                     c10::str(v.sizes()));
  }
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    throw UsageError(who + str(k.size(1)) + " key/value heads do not divide " + str(q.size(1)) +
                     " query heads; give a kv head count that divides the head count");
  }
  const int size = cp.joined() ? cp.size() : 1, rank = cp.joined() ? cp.rank() : 0;
  if (split.degree != size || split.rank != rank) {
    throw UsageError(who + "the split is for rank " + str(split.rank) + " of " + str(split.degree) +
                     " but the group's rank is " + str(rank) + " of " + str(size) +
                     "; make the ContextSplit from the group's size() and rank()");
  }
}

}  // namespace

void ContextSplit::check(int64_t length) const {
  if (degree < 1 || rank < 0 || rank >= degree) {
    throw UsageError("context parallelism: rank " + str(rank) + " of degree " + str(degree) +
                     " is out of range; the degree is at least 1 and the rank below it");
  }
  if (length % chunks() != 0) {
    throw UsageError("context parallelism: a sequence of " + str(length) +
                     " tokens does not cut into " + str(chunks()) + " equal chunks (degree " +
                     str(degree) + (balanced() ? ", load-balanced: 2 per rank" : "") +
                     "); make the sequence length a multiple of " + str(chunks()));
  }
}

at::Tensor ContextSplit::positions_of(int rank_of, int64_t length) const {
  check(length);
  const int64_t c = length / chunks();
  if (!balanced()) return at::arange(rank_of * c, (rank_of + 1) * c, at::kLong);
  const int64_t tail = 2 * degree - 1 - rank_of;
  return at::cat({at::arange(rank_of * c, (rank_of + 1) * c, at::kLong),
                  at::arange(tail * c, (tail + 1) * c, at::kLong)});
}

at::Tensor ContextSplit::positions(int64_t length) const { return positions_of(rank, length); }

at::Tensor ContextSplit::shard(const at::Tensor& x, int64_t dim) const {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  check(x.size(d));
  const int64_t c = x.size(d) / chunks();
  if (!balanced()) return x.narrow(d, rank * c, c).contiguous();
  return at::cat({x.narrow(d, rank * c, c), x.narrow(d, (2 * degree - 1 - rank) * c, c)}, d);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const Dist& cp, const ContextSplit& split,
                          const RingAttentionOptions& options) {
  check_inputs(q, k, v, cp, split);
  auto ring = c10::make_intrusive<Ring>();
  ring->cp = cp;
  ring->split = split;
  ring->options = options;
  ring->length = q.size(2) * split.degree;
  split.check(ring->length);
  return RingAttention::apply(q, k, v, c10::IValue::make_capsule(std::move(ring)));
}

}  // namespace scaletrain
