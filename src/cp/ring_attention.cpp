// Note [Ring attention]
// ~~~~~~~~~~~~~~~~~~~~~
// Rank r of N holds the queries, keys and values of its tokens (ContextSplit): one chunk of the
// sequence in order, or two (a head and a tail) load-balanced. Step i = 0 … N−1 it holds the keys
// and values of rank s = r − i (mod N), computes its queries against them, and passes them on to
// rank r + 1 while it computes (the next hop is posted before the step's kernels). A step is a
// few chunk pairs (a query chunk of this rank against a key chunk of rank s), each one kernel
// call, chosen by the chunks' place in the sequence (causal):
//
//     query chunk after the key chunk     every pair seen: attention without a mask
//     the same chunk (rank r's own)       causal attention within it
//     query chunk before the key chunk    nothing seen: not computed
//
// so no mask is ever built and no hidden pair is computed (load-balanced at N = 2: each rank
// computes 3 of its 4 chunk pairs' worth, a half of the causal whole, as the other rank does).
// A pair gives each query row a partial output o_i and the log-sum-exp l_i of its scores; the
// rows' running (o, l) take each in:
//
//     l' = log(e^l + e^l_i)        o' = o · e^(l − l') + o_i · e^(l_i − l')
//
// which is exact: after every pair, o is the softmax over every key seen, whatever the order.
// Rank r's own chunks come first, and each row sees itself, so the running l is finite from the
// first pair. A pair's kernel is the device's fused attention that also gives the log-sum-exp
// (on the CPU, ATen's flash attention: nothing of size chunk² is held), or the plain products
// (RingAttentionOptions::fused false, and devices without one).
//
// Backward computes each pair's share of the gradients from q, k, v, the final output O and the
// final l (flash attention's backward: with P = e^(scores − l) and D = rowsum(dO ∘ O),
//
//     dV = Pᵀ dO     dS = P ∘ (dO Vᵀ − D)     dQ = dS K · scale     dK = dSᵀ Q · scale
//
// for each pair), so nothing of size S² is kept between forward and backward. The keys and
// values go round the ring again, and with them an accumulator of their gradients: each rank
// adds its queries' share and passes it on, and the N-th hop brings a block's gradient home.
// Grouped-query attention exchanges the kv heads only; each is repeated for its query heads in
// the pair, and its gradients summed back over them. Half and bfloat16 inputs are computed in
// float32 (the merges, the gradients' sums), and the result cast back.
//
// Note [Ring attention with dropout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Dropout acts on the probabilities, after the softmax: out = (P ∘ M / (1 − p)) V with P the
// softmax over every key and M the mask. A pair's P_i = e^(scores − l_i) is its rows' softmax over
// its keys; the merge weighs pair i by e^(l_i − L), and e^(l_i − L) · P_i is P over those keys.
// So each pair applies its block of the mask to its own P_i (its log-sum-exp l_i taken before,
// over the undropped scores) and the merge stays as it is. Backward, with D = rowsum(dO ∘ O) of
// the final (dropped) output, dS = P ∘ ((dO Vᵀ) ∘ M / (1 − p) − D) and dV = (P ∘ M / (1 − p))ᵀ dO:
// D is still Σ_j P_ij dP_ij. The mask is the unsplit model's: each rank draws the whole
// [B, H, S, S] one as coordinated_dropout() would over the unsplit probabilities, keeps its rows
// (its tokens' positions) and hands each pair its block; the fused kernel is not used then.

#include <ATen/ATen.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "scaletrain/context_parallel.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kKvTag = 7301, kGradTag = 7302;  // point-to-point tags of the two exchanges

std::string str(int64_t v) { return std::to_string(v); }

// A rank's chunks of the sequence: their index among the split's chunks and where each starts
// in the rank's slice.
struct Chunk {
  int64_t id, at;
};

std::vector<Chunk> chunks_of(const ContextSplit& split, int rank, int64_t size) {
  std::vector<Chunk> out;
  for (int64_t id : split.chunk_ids(rank)) out.push_back({id, size * int64_t(out.size())});
  return out;
}

// UsageError unless `split` is for rank `rank` of `size`.
void check_split(const ContextSplit& split, int size, int rank, const std::string& who) {
  if (split.degree != size || split.rank != rank) {
    throw UsageError(who + "the split is for rank " + str(split.rank) + " of " + str(split.degree) +
                     " but the group's rank is " + str(rank) + " of " + str(size) +
                     "; make the ContextSplit from the group's size() and rank()");
  }
}

// Keys or values of a pair for the query heads: each kv head repeated.
at::Tensor for_heads(const at::Tensor& t, int64_t group) {
  return group > 1 ? t.repeat_interleave(group, 1) : t;
}

// Gradients of the repeated heads summed back onto their kv head.
at::Tensor to_kv_heads(const at::Tensor& g, int64_t group) {
  if (group == 1) return g;
  const auto s = g.sizes();
  return g.reshape({s[0], s[1] / group, group, s[2], s[3]}).sum(2);
}

// A pair's attention dropout: its part of the rank's mask (undefined: none), and 1 − p.
struct PairDropout {
  at::Tensor mask;
  double keep = 1;
  // The probabilities as the values see them: dropped, the kept ones scaled by 1 / keep.
  at::Tensor apply(const at::Tensor& p) const {
    return mask.defined() ? p * mask.to(p.scalar_type()) / keep : p;
  }
};

// One pair's attention and the log-sum-exp of its rows' scores (before any dropout: Note [Ring
// attention with dropout]).
std::tuple<at::Tensor, at::Tensor> pair_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, bool causal, double scale,
                                                bool fused, const PairDropout& drop) {
  if (fused && q.is_cpu() && !drop.mask.defined()) {
    return at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
  }
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (causal) {
    const auto future = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  at::Tensor l = at::logsumexp(s, -1);
  return {at::matmul(drop.apply(s.sub_(l.unsqueeze(-1)).exp_()), v), l};
}

// One pair's gradients of q, k and v, from the final output `o` and log-sum-exp `l` of its rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pair_backward(
    const at::Tensor& d_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& o, const at::Tensor& l, bool causal, double scale, bool fused,
    const PairDropout& drop) {
  if (fused && q.is_cpu() && !drop.mask.defined()) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, o, l, 0.0,
                                                                    causal, {}, scale);
  }
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (causal) {
    const auto future = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    s.masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  const at::Tensor p = s.sub_(l.unsqueeze(-1)).exp_();
  const at::Tensor delta = (d_out * o).sum(-1, /*keepdim=*/true);
  const at::Tensor ds = p * (drop.apply(at::matmul(d_out, v.transpose(-2, -1))) - delta);
  return {at::matmul(ds, k).mul_(scale), at::matmul(ds.transpose(-2, -1), q).mul_(scale),
          at::matmul(drop.apply(p).transpose(-2, -1), d_out)};
}

// The ring as this rank sees it: its group, its split, its peers, and the traffic counters.
struct Ring : torch::CustomClassHolder {
  Dist cp;  // a handle on the caller's group (its backend is shared)
  ContextSplit split;
  RingAttentionOptions options;
  int64_t chunk = 0;  // tokens per chunk
  at::Tensor mask;    // attention dropout: this rank's rows of the whole mask, [B, H, S/N, S]
  // The dropout of the pair of query chunk `qc` (rows of this rank) and key chunk `kc`.
  PairDropout dropout(const Chunk& qc, const Chunk& kc) const {
    if (!mask.defined()) return {};
    return {mask.narrow(2, qc.at, chunk).narrow(3, kc.id * chunk, chunk), 1 - options.dropout.p};
  }
  int next() const { return (split.rank + 1) % split.degree; }
  int prev() const { return (split.rank + split.degree - 1) % split.degree; }
  int source(int step) const { return (split.rank - step + split.degree) % split.degree; }
  double scale(const at::Tensor& q) const {
    return options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  }

  // The chunk pairs of step `i`: (query chunk, key chunk, causal), the key chunk's place in the
  // block that rank source(i) sent.
  std::vector<std::tuple<Chunk, Chunk, bool>> pairs(int i) const {
    std::vector<std::tuple<Chunk, Chunk, bool>> out;
    for (const Chunk& qc : chunks_of(split, split.rank, chunk)) {
      for (const Chunk& kc : chunks_of(split, source(i), chunk)) {
        if (!options.causal) {
          out.emplace_back(qc, kc, false);
        } else if (qc.id >= kc.id) {
          out.emplace_back(qc, kc, qc.id == kc.id);
        }
      }
    }
    return out;
  }

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

at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A step's pairs into the rows' running output and log-sum-exp.
void merge_step(const Ring& ring, int i, const at::Tensor& q, const at::Tensor& kv, at::Tensor& out,
                at::Tensor& lse, int64_t group) {
  const int64_t c = ring.chunk;
  for (const auto& [qc, kc, causal] : ring.pairs(i)) {
    const at::Tensor k = for_heads(kv[0].narrow(2, kc.at, c), group);
    const at::Tensor v = for_heads(kv[1].narrow(2, kc.at, c), group);
    auto [o, l] = pair_forward(q.narrow(2, qc.at, c).contiguous(), k.contiguous(), v.contiguous(),
                               causal, ring.scale(q), ring.options.fused, ring.dropout(qc, kc));
    at::Tensor lo = lse.narrow(2, qc.at, c), oo = out.narrow(2, qc.at, c);
    const at::Tensor ln = at::logaddexp(lo, l);
    oo.copy_(oo * at::exp(lo - ln).unsqueeze(-1) + o * at::exp(l - ln).unsqueeze(-1));
    lo.copy_(ln);
  }
}

// A step's pairs' gradients: dQ into `dq`, dK and dV of the block's keys into `dkv`.
void backward_step(const Ring& ring, int i, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& d_out, const at::Tensor& out, const at::Tensor& lse,
                   int64_t group, at::Tensor& dq, at::Tensor& dkv) {
  const int64_t c = ring.chunk;
  for (const auto& [qc, kc, causal] : ring.pairs(i)) {
    const at::Tensor k = for_heads(kv[0].narrow(2, kc.at, c), group);
    const at::Tensor v = for_heads(kv[1].narrow(2, kc.at, c), group);
    auto rows = [&](const at::Tensor& t) { return t.narrow(2, qc.at, c).contiguous(); };
    auto [gq, gk, gv] =
        pair_backward(rows(d_out), rows(q), k.contiguous(), v.contiguous(), rows(out), rows(lse),
                      causal, ring.scale(q), ring.options.fused, ring.dropout(qc, kc));
    dq.narrow(2, qc.at, c).add_(gq);
    dkv[0].narrow(2, kc.at, c).add_(to_kv_heads(gk, group));
    dkv[1].narrow(2, kc.at, c).add_(to_kv_heads(gv, group));
  }
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::IValue held) {
    const Ring& ring = *static_cast<Ring*>(held.toCapsule().get());
    const auto type = compute_type(q);
    const at::Tensor qf = q.to(type).contiguous();
    const int64_t group = q.size(1) / k.size(1);
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
      merge_step(ring, i, qf, block.to(type), out, lse, group);
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

variable_list RingAttention::backward(AutogradContext* ctx, variable_list g) {
  const Ring& ring = *static_cast<Ring*>(ctx->saved_data.at("ring").toCapsule().get());
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
  const auto type = out.scalar_type();
  const at::Tensor qf = q.to(type).contiguous(), d_out = g[0].to(type).contiguous();
  const int64_t group = q.size(1) / k.size(1);
  at::Tensor dq = at::zeros_like(qf);
  at::Tensor block = at::stack({k, v}).contiguous(), next;
  at::Tensor dkv = at::zeros(block.sizes(), block.options().dtype(type)), dkv_next;
  std::vector<Pending> kv_hop, grad_hop;
  for (int i = 0; i < ring.split.degree; ++i) {
    if (i + 1 < ring.split.degree) {
      next = at::empty_like(block);
      kv_hop = ring.hop(block, next, kKvTag, true);
    }
    backward_step(ring, i, qf, block.to(type), d_out, out, lse, group, dq, dkv);
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

// The probabilities' mask over the whole sequence, [B, H, S, S] (this rank's heads; 1 kept, 0
// dropped), as coordinated_dropout() draws it over the unsplit probabilities.
at::Tensor dropout_mask(const AttentionDropout& drop, at::IntArrayRef q, int64_t length,
                        const at::TensorOptions& options) {
  if (drop.heads.parts > 1 && drop.heads.dim != 1) {
    throw UsageError(
        "ring_attention: the dropout's heads are a part along dimension 1 "
        "(part_of(tp, 1)), not " +
        str(drop.heads.dim));
  }
  return coordinated_dropout_mask({q[0], q[1], length, length}, options,
                                  {drop.p, drop.heads, drop.generator});
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
  check_split(split, cp.joined() ? cp.size() : 1, cp.joined() ? cp.rank() : 0, who);
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

std::vector<int64_t> ContextSplit::chunk_ids(int rank_of) const {
  if (!balanced()) return {rank_of};
  return {rank_of, 2 * degree - 1 - rank_of};
}

at::Tensor ContextSplit::positions_of(int rank_of, int64_t length) const {
  check(length);
  const int64_t c = length / chunks();
  std::vector<at::Tensor> parts;
  for (int64_t id : chunk_ids(rank_of))
    parts.push_back(at::arange(id * c, (id + 1) * c, at::kLong));
  return at::cat(parts);
}

at::Tensor ContextSplit::positions(int64_t length) const { return positions_of(rank, length); }

at::Tensor ContextSplit::shard(const at::Tensor& x, int64_t dim) const {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  check(x.size(d));
  const int64_t c = x.size(d) / chunks();
  std::vector<at::Tensor> parts;
  for (int64_t id : chunk_ids(rank)) parts.push_back(x.narrow(d, id * c, c));
  return at::cat(parts, d);
}

void ContextParallelism::set(const Dist* cp, const ContextSplit& s) {
  if (!cp) {
    group.reset();
    split = {};
    return;
  }
  check_split(s, cp->size(), cp->rank(), "context parallelism: ");
  group = *cp;
  split = s;
}

at::Tensor ContextParallelism::positions(int64_t n, const at::TensorOptions& options) const {
  const auto longs = options.dtype(at::kLong);
  if (!on()) return at::arange(n, longs);
  return split.positions(n * split.degree).to(longs.device());
}

at::Tensor ContextParallelism::attention(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, std::optional<double> scale,
                                         const AttentionDropout& dropout) const {
  if (on()) {
    RingAttentionOptions o;
    o.scale = scale;
    o.dropout = dropout;
    return ring_attention(q, k, v, *group, split, o);
  }
  if (dropout.p > 0) {  // the three products, the probabilities' mask drawn over them
    const int64_t group = k.size(1) > 0 ? q.size(1) / k.size(1) : 1;
    at::Tensor att = at::matmul(q, for_heads(k, group).transpose(-2, -1));
    att = scale ? att * *scale : att / std::sqrt(static_cast<double>(q.size(-1)));
    const int64_t t = q.size(2);
    const auto future = at::ones({t, t}, at::TensorOptions().dtype(at::kBool)).triu(1);
    att = at::softmax(
        att.masked_fill(future.to(q.device()), -std::numeric_limits<double>::infinity()), -1);
    att = coordinated_dropout(att, {dropout.p, dropout.heads, dropout.generator});
    return at::matmul(att, for_heads(v, group));
  }
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale,
                                          /*enable_gqa=*/q.size(1) != k.size(1));
}

at::Tensor ContextParallelism::shard(const at::Tensor& x, int64_t dim) const {
  return on() ? split.shard(x, dim) : x;
}

at::Tensor ContextParallelism::gather(const at::Tensor& slice, int64_t dim) const {
  if (!on()) return slice;
  const int64_t d = dim < 0 ? dim + slice.dim() : dim;
  const auto parts = group->all_gather(slice.contiguous(), "context-parallel gather of outputs");
  const int64_t length = slice.size(d) * split.degree;
  auto sizes = slice.sizes().vec();
  sizes[static_cast<size_t>(d)] = length;
  at::Tensor whole = at::empty(sizes, slice.options());
  for (int r = 0; r < split.degree; ++r) {
    whole.index_copy_(d, split.positions_of(r, length).to(slice.device()),
                      parts[static_cast<size_t>(r)].to(slice.device()));
  }
  return whole;
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const Dist& cp, const ContextSplit& split,
                          const RingAttentionOptions& options) {
  check_inputs(q, k, v, cp, split);
  auto ring = c10::make_intrusive<Ring>();
  ring->cp = cp;
  ring->split = split;
  ring->options = options;
  const int64_t length = q.size(2) * split.degree;
  split.check(length);
  ring->chunk = length / split.chunks();
  const AttentionDropout& drop = options.dropout;
  if (drop.p > 0) {  // Note [Ring attention with dropout]
    at::Tensor mask = dropout_mask(drop, q.sizes(), length, q.options());
    ring->mask = mask.index_select(2, split.positions(length).to(q.device())).to(at::kBool);
  }
  return RingAttention::apply(q, k, v, c10::IValue::make_capsule(std::move(ring)));
}

}  // namespace scaletrain
