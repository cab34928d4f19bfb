#pragma once
// Mixture of experts and expert parallelism. A MoE layer stands where a transformer's MLP
// stands: a router scores each token against E experts (small MLPs), the token goes to its top
// k, and the layer's output is the experts' outputs weighted by the router's probabilities.
// Expert parallelism spreads the E experts over the N ranks of a group, E / N each; every token
// then travels to the ranks of its experts and back, by two all-to-alls each way (Note [Token
// dispatch] in src/ep/dispatch.cpp):
//
//   scaletrain::MoE moe(scaletrain::MoEOptions{/*dim*/ 64, /*hidden*/ 256, /*experts*/ 8});
//   moe->expert_parallel(ep);          // every rank of `ep` held the same weights before
//   at::Tensor y = moe->forward(x);    // x: [..., 64], this rank's tokens; y: the same shape
//
// Routing is dropless: every token reaches its k experts, however many pick the same one. The
// router's load-balancing loss (Switch Transformer's: E · Σ_e f_e · P_e, with f_e the share of
// this rank's token slots that go to expert e and P_e the mean probability the router gives e)
// enters the backward with the coefficient MoEOptions::aux_loss_coef: its gradient is added as
// if the loss had been added to the model's, and the loss reported stays the model's own
// (Megatron-Core's auto-scaler does the same).
//
// The wire, per layer and rank, forward: one all-to-all of E counts (int64), then one of the
// token rows (k · tokens · dim elements leave, as many as the experts here receive arrive),
// and the same rows back; backward, the two row exchanges again in reverse. At ep 1 none.
// With the experts sharded over edp (MoEImpl::shard_experts), one all-gather of the layer's
// E' experts forward (each rank sends its E'/M) and one reduce-scatter of their gradients back.

#include <ATen/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "scaletrain/dist.h"

namespace scaletrain {

struct MoEOptions {
  MoEOptions(int64_t dim, int64_t hidden, int64_t experts)
      : dim(dim), hidden(hidden), experts(experts) {}
  int64_t dim, hidden, experts;
  int64_t top_k = 2;            ///< experts per token, 1 … experts
  double aux_loss_coef = 0.01;  ///< the load-balancing loss's weight; 0: none
  bool swiglu = false;          ///< Llama's gated MLP (w1, w3, w2); false: GPT's GELU MLP (w1, w2)
  bool normalize_top_k = true;  ///< the top k probabilities rescaled to sum to 1 (k > 1)
  /// Throws UsageError naming the value and the fix: a degree or size below 1, top_k above the
  /// experts, a negative coefficient.
  void check() const;
};

/// What the dispatches sent, for a program that wants to see it (a test, a benchmark).
struct ExpertTraffic {
  std::atomic<int64_t> exchanges{0};        // all-to-alls, counts and rows, forward and backward
  std::atomic<int64_t> rows_sent{0};        // token rows this rank sent to other ranks
  std::atomic<int64_t> shard_exchanges{0};  // sharded experts' gathers and reduce-scatters
};

/// Tokens on their way to the experts of this rank: dispatch()'s result, combine()'s input.
struct Dispatched {
  at::Tensor rows;                       ///< [R, dim], grouped by local expert, in its order
  std::vector<int64_t> rows_per_expert;  ///< R split by local expert (length E / N)
  // How they came, for combine(): the token of each sorted slot, the slots' order, the rows
  // exchanged with each rank, and the regrouping of what arrived.
  at::Tensor token_of, order, regroup;
  std::vector<int64_t> sent, received;
  std::shared_ptr<const Dist> ep;  // null at ep 1
  ExpertTraffic* traffic = nullptr;
};

/// Sends each of this rank's tokens (x: [T, dim]) to the ranks holding its experts
/// (expert_ids: [T, k] int64, global ids in [0, experts); rank r of `ep` holds experts
/// [r · E/N, (r + 1) · E/N)). Collective over `ep` (null: one rank, no message). Differentiable in
/// x. Throws UsageError for ids out of range, shapes that disagree, or N not dividing experts.
Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, int64_t experts,
                    const Dist* ep, ExpertTraffic* traffic = nullptr);

/// The experts' outputs for dispatch()'s rows (`outputs`: [R, dim'] in rows' order) sent back to
/// their tokens, and each token's k outputs summed with `weights` ([T, k], the router's): [T,
/// dim']. Collective over the same group. Differentiable in outputs and weights. With weights
/// 1/k and outputs = rows it gives back x, forward and backward.
at::Tensor combine(const at::Tensor& outputs, const Dispatched& d, const at::Tensor& weights);

/// The router's choice for tokens x ([T, dim]) under `router` ([E, dim]): each token's top k
/// experts (ids [T, k] int64, best first) and their weights ([T, k], the softmax over all E in
/// float32 at least, rescaled over the k when normalize_top_k), with the load-balancing loss of
/// these tokens (a scalar; 0 when aux_loss_coef is 0).
struct Routing {
  at::Tensor expert_ids, weights, aux_loss;
  at::Tensor tokens_per_expert;  ///< [E] int64: this rank's token slots each expert got
};
Routing route(const at::Tensor& x, const at::Tensor& router, const MoEOptions& options);

/// A mixture-of-experts feed-forward layer. Parameters (the experts grouped in one tensor each,
/// TorchTitan's names): router [E, dim]; w1 [E', dim, hidden], w2 [E', hidden, dim] and, with
/// swiglu, w3 [E', dim, hidden], where E' = E / N are this rank's experts (E' = E at ep 1), in
/// global order from first_expert() (E'/M of them after shard_experts()).
class MoEImpl : public torch::nn::Cloneable<MoEImpl> {
 public:
  explicit MoEImpl(const MoEOptions& options);
  void reset() override;
  /// x: [..., dim]; returns the same shape. Collective over the ep group when set.
  at::Tensor forward(const at::Tensor& x);
  /// Spreads the experts over `ep` (null: back to none, which needs all E here): this rank keeps
  /// experts [r · E/N, (r + 1) · E/N) of the E it holds now. Throws UsageError when N does not
  /// divide E, naming both and the fix, or when the layer already holds a part.
  void expert_parallel(const Dist* ep);
  /// FSDP over the experts (TorchTitan's "efsdp"): `edp` is the group of ranks that hold the
  /// same experts (the ep group's replicas: M ranks). This rank then keeps E'/M of its E':
  /// experts [m · E'/M, (m + 1) · E'/M) of them, m its rank in `edp`, as w1, w2, w3. Each forward
  /// gathers the E' over `edp` (one all-gather per layer) and its backward sums their gradients
  /// over `edp` into each rank's part (one reduce-scatter): after backward, a part's .grad is the
  /// sum over the M ranks' tokens. The gathered experts live until the backward (FSDP's
  /// reshard_after_forward false). Collective over `edp` in every forward and backward. Null or
  /// one rank: nothing. Throws UsageError when M does not divide E' (naming both and the fix) or
  /// the layer is sharded already. Note [Experts sharded over edp] in src/ep/moe.cpp.
  void shard_experts(const Dist* edp);
  /// The first global expert index this rank computes, and how many (E'); the experts it holds
  /// (E'/M sharded, else E').
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return w1.size(0) * (edp_ ? edp_->size() : 1); }
  int64_t held_experts() const { return w1.size(0); }
  const Dist* ep() const { return ep_.get(); }
  const Dist* edp() const { return edp_.get(); }

  MoEOptions options;
  at::Tensor router, w1, w2, w3;
  /// Multiplies the load-balancing loss's gradient: the trainer sets 1 / micro-batches per step,
  /// as it divides the model's loss.
  double aux_loss_scale = 1.0;
  /// The last forward's load-balancing loss and token slots per expert, for metrics.
  at::Tensor last_aux_loss, last_tokens_per_expert;
  ExpertTraffic* traffic = nullptr;

 private:
  at::Tensor experts_forward(const Dispatched& d, const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& w3) const;
  std::shared_ptr<const Dist> ep_, edp_;
  int64_t first_ = 0;
};
TORCH_MODULE(MoE);

/// Every MoE layer of `module` (in registration order), for a trainer or a program that sets
/// them all at once.
std::vector<MoEImpl*> moe_layers(torch::nn::Module& module);

}  // namespace scaletrain
