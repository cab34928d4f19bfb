#pragma once
// Context parallelism: the N ranks of a group each hold a slice of every sequence, and attention
// runs as ring attention. Each rank keeps its queries; the keys and values travel round the
// ring, one hop a step, and each rank merges the partial results of its queries against each
// block it sees by their log-sum-exp (Note [Ring attention] in src/cp/ring_attention.cpp).
//
//   ContextSplit split{cp.size(), cp.rank()};               // load-balanced by default
//   auto ids = split.shard(tokens, 1);                       // this rank's slice of each sequence
//   auto pos = split.positions(tokens.size(1));              // and where its tokens stand
//   ... q, k, v: [batch, heads, ids.size(1), head_dim], rotary embeddings at `pos` ...
//   auto out = ring_attention(q, k, v, cp, split);           // = causal attention over it all
//
// Causal load balancing: a sequence cut into N chunks gives rank N − 1 the most work (its
// queries see every key) and rank 0 the least. Balanced, the sequence is cut into 2N chunks and
// rank r holds chunks r and 2N − 1 − r, a head and a tail: every rank then attends to the same
// number of (query, key) pairs. Each rank's tokens keep their true positions: positions() says
// them, for position embeddings, rotary embeddings and the loss.
//
// Attention dropout (RingAttentionOptions::dropout) draws the unsplit model's masks: each rank
// draws the whole mask and keeps its rows (Note [Ring attention with dropout]).
//
// The wire, per call on each rank: N − 1 messages forward, each a block of keys and values
// (2 · batch · kv_heads · S/N · head_dim elements); backward, N − 1 of keys and values and N of
// their gradients (each block's gradient comes home to its rank on the last hop). Blocks that
// no query of a rank may see (causal) are not computed, but still pass on.

#include <ATen/Tensor.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "scaletrain/coordinated_dropout.h"
#include "scaletrain/dist.h"

namespace scaletrain {

/// How the sequences of a batch are cut over the `degree` ranks of a context-parallel group.
struct ContextSplit {
  int degree = 1;
  int rank = 0;
  /// Rank r holds chunks r and 2N − 1 − r of 2N (causal load balancing); false: chunk r of N.
  bool load_balanced = true;

  /// Whether the cut is balanced: asked for, and more than one rank.
  bool balanced() const { return load_balanced && degree > 1; }
  /// The number of chunks a sequence is cut into: 2N balanced, N otherwise.
  int64_t chunks() const { return balanced() ? 2 * degree : degree; }
  /// The chunks rank `rank_of` holds, in the order its slice keeps them: {r} in order, {r,
  /// 2N − 1 − r} balanced (chunk k is tokens k · L/chunks() … (k + 1) · L/chunks() − 1).
  std::vector<int64_t> chunk_ids(int rank_of) const;
  /// The global positions of this rank's tokens, in the order shard() keeps them: an int64
  /// tensor of length / degree, on the CPU. Throws UsageError (naming the length, the degree and
  /// the fix) when chunks() does not divide `length`.
  at::Tensor positions(int64_t length) const;
  /// The same for any rank of the group.
  at::Tensor positions_of(int rank_of, int64_t length) const;
  /// This rank's slice of `x` along `dim` (the sequence), contiguous. Same errors.
  at::Tensor shard(const at::Tensor& x, int64_t dim) const;
  /// Throws UsageError when the degree or rank is out of range, or chunks() does not divide
  /// `length` (the message names both and the fix).
  void check(int64_t length) const;
};

/// What the ring attention calls sent, for a program that wants to see it (a test, a benchmark):
/// counts of messages and bytes, added to by every call given it (atomics: threads of one
/// process may share one).
struct RingTraffic {
  std::atomic<int64_t> forward_messages{0};
  std::atomic<int64_t> backward_messages{0};
  std::atomic<int64_t> bytes{0};
};

/// Dropout on the attention probabilities (training), with the masks the unsplit model draws:
/// the mask of the whole [batch, heads · heads.parts, S, S] probabilities is drawn from
/// `generator` (unset: the device's default) as coordinated_dropout() draws it
/// (coordinated_dropout.h), and each rank keeps its heads (`heads`: tensor parallelism's part of
/// them) and its rows. So the generator must be in the same state on every rank of the cp group
/// (and of the tp group), and a rank draws S² numbers per head, as the unsplit model does.
struct AttentionDropout {
  double p = 0;  ///< the probability of dropping one, in [0, 1); 0: none
  TensorPart heads;
  std::optional<at::Generator> generator;
};

struct RingAttentionOptions {
  bool causal = true;
  /// The scores' scale; unset: 1 / sqrt(head_dim), as scaled_dot_product_attention's default.
  std::optional<double> scale;
  /// Where to count the messages; null: not counted. Must outlive the backward.
  RingTraffic* traffic = nullptr;
  /// Each chunk pair through the device's fused attention kernel that also gives the
  /// log-sum-exp (on the CPU, ATen's flash attention); false: the plain products (the
  /// reference, and the path on devices without such a kernel).
  bool fused = true;
  /// With p > 0 the pairs run through the plain products (a pair's mask applied to its
  /// probabilities, after their log-sum-exp) and each rank keeps its rows' mask, S/N × S per
  /// head, until the backward.
  AttentionDropout dropout;
};

/// Attention of this rank's queries over the keys and values of the whole sequence, which the
/// ranks of `cp` hold in slices cut by `split` (split.degree == cp.size(), split.rank ==
/// cp.rank()). q: [batch, heads, S/N, head_dim]; k, v: [batch, kv_heads, S/N, head_dim], with
/// kv_heads dividing heads (grouped-query attention: each kv head serves heads / kv_heads query
/// heads, as Llama's). Returns this rank's rows of scaled_dot_product_attention over the whole
/// sequence (causal by the tokens' true positions), in q's dtype; the scores, their softmax
/// statistics and the gradients are computed in float32 for half and bfloat16 inputs.
/// Differentiable in q, k and v; a collective over `cp` forward and backward (every rank calls
/// it in the same order). At degree 1 it is plain attention, with no message. Throws UsageError
/// for shapes that disagree, a split of another degree or rank than `cp`'s, or kv_heads that
/// do not divide heads.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const Dist& cp, const ContextSplit& split,
                          const RingAttentionOptions& options = {});

/// What a model keeps for context parallelism, for its embedding and its attention layers: set
/// through Model::context_parallel (the trainer's TrainerOptions::context_parallel), off by
/// default. Off, positions() is 0 … n − 1 and attention() is scaled_dot_product_attention over
/// the whole sequence; on, the rank's positions and ring_attention over the group.
struct ContextParallelism {
  std::optional<Dist> group;  // set: on
  ContextSplit split;

  bool on() const { return group.has_value() && split.degree > 1; }
  /// Turns it on over `cp` (split.degree == cp->size(), split.rank == cp->rank(); UsageError
  /// otherwise), or off (null).
  void set(const Dist* cp, const ContextSplit& s);
  /// The global positions of the `n` tokens this rank's slice of a sequence holds (the whole
  /// sequence is n · degree long), as an int64 tensor with `options`' device.
  at::Tensor positions(int64_t n, const at::TensorOptions& options) const;
  /// Causal attention (q: [batch, heads, n, head_dim], k and v with kv heads dividing them) over
  /// the whole sequence, with the scores scaled by `scale` (unset: head_dim^-½), and `dropout`
  /// on its probabilities (off: the three products, the softmax's mask by coordinated_dropout()
  /// with dropout.heads; on: ring_attention's), the same masks on and off.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       std::optional<double> scale = std::nullopt,
                       const AttentionDropout& dropout = {}) const;
  /// This rank's slice of `x` along `dim` (the sequence), or x when off.
  at::Tensor shard(const at::Tensor& x, int64_t dim) const;
  /// The whole sequence along `dim` from every rank's `slice` (collective over the group; the
  /// tokens back in their order), or `slice` when off. Not differentiable: for evaluation.
  at::Tensor gather(const at::Tensor& slice, int64_t dim) const;
};

}  // namespace scaletrain
