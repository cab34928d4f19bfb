#pragma once
// Tensor parallelism (Megatron-LM's, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
// et al. 2022) for LibTorch modules, over a process group of the tensor-parallel ranks (the "tp"
// dimension of a DeviceMesh, mesh.h; mesh_groups() in dist.h makes it).
//
// A user's transformer block is written once, with ParallelLinear and ParallelEmbedding where
// torch::nn::Linear and torch::nn::Embedding would be (the same parameters under the same names,
// the same function while no plan is applied), and parallelised by a plan that names which layer
// takes which style, as PyTorch's parallelize_module does:
//
//   struct Mlp : torch::nn::Module {
//     scaletrain::ParallelLinear fc{nullptr}, proj{nullptr};
//     Mlp() { fc = register_module("fc", scaletrain::ParallelLinear(64, 256));
//             proj = register_module("proj", scaletrain::ParallelLinear(256, 64)); }
//     at::Tensor forward(const at::Tensor& x) { return proj(at::gelu(fc(x))); }
//   };
//   scaletrain::DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, dist.size());   // 4 ranks
//   auto groups = scaletrain::mesh_groups(dist, mesh);
//   scaletrain::TensorParallelPlan plan;
//   plan["fc"] = scaletrain::colwise();                   // weight rows split: output sharded
//   plan["proj"] = scaletrain::rowwise();                 // weight columns split: output summed
//   scaletrain::parallelize_module(*mlp, groups.at("tp"), plan);   // slices the weights in place
//
// Note [Conjugate regions]. A column-parallel layer takes the whole input on every rank and gives
// each rank its slice of the output features; a row-parallel layer takes such a slice and gives
// the whole output as the sum over the ranks. Between them nothing is communicated (an
// element-wise activation, attention over this rank's heads). Two operators make it exact:
// f = copy_to_region (identity forward, all-reduce of the gradient backward) in front of the
// column-parallel layer, and g = reduce_from_region (all-reduce forward, identity backward)
// behind the row-parallel one. With sequence parallelism the regions outside (LayerNorm,
// dropout, the residual) hold a slice of the sequence instead of all of it: f becomes an
// all-gather along the sequence (reduce-scatter of the gradient) and g a reduce-scatter (all-gather
// of the gradient), which move the same bytes as the two all-reduces they replace, and the
// activations there shrink by the degree. A parameter that the plan leaves whole and that a
// sequence-parallel region uses (a LayerNorm's, a rowwise layer's bias, a position table) then
// gets from each rank only the part of its gradient that this rank's positions give. A
// sequence-parallel plan registers their sum: every backward sums each such gradient over the
// group as it arrives, before it accumulates into .grad, so nothing is called after backward and
// nothing can be forgotten (sum_partial_gradients(); Note [Partial gradients summed in backward]
// in src/tp/sequence_parallel.cpp).
//
// Sequence parallelism in a model of your own. The plan takes every parameter it leaves whole to
// be used on this rank's slice of the sequence ([batch, T/t, features], t = tp.size()):
//   - the residual stream, LayerNorms and dropout between the split layers hold this rank's
//     slice: a colwise() layer gathers it (f), a rowwise() layer reduce-scatters into it (g);
//   - a replicated embedding (a position table, or a token embedding left whole) looks up this
//     rank's positions only: ids.narrow(1, tp.rank() * T/t, T/t). Not the whole sequence and then
//     scatter_to_sequence(): that backward gathers the whole gradient onto every rank, and the
//     registered sum would count it t times;
//   - a replicated head runs on this rank's positions, its logits gathered along the sequence
//     with gather_from_region(logits, tp, 1) (backward: this rank's slice, nothing summed) before
//     a loss over the whole sequence, the same on every rank. Or split it: a colwise() head with
//     sequence parallelism gathers its input, and vocab_parallel_cross_entropy() takes its
//     vocabulary slice (Megatron's, the zoo's GPT);
//   - dropout there draws the unsplit model's masks with coordinated_dropout()
//     (coordinated_dropout.h), from generators in the same state on every rank of the group.
// A parameter used whole on the whole sequence on every rank would have its gradient counted t
// times: keep such layers out of the module a sequence-parallel plan is applied to, or split them.
//
// Meshes. The tensor-parallel group is one dimension of a DeviceMesh; the others compose as they
// are: DistributedDataParallel or ShardedDataParallel (ZeRO stages 1 to 3) over the "dp" group of
// a split model average each slice over its replicas, with sequence parallelism too (the
// registered sums have made the gradients whole before DDP's or ZeRO's hooks read them; sums
// over dp and over tp commute). tests/tensor_parallel_test.cpp checks them against the single
// process; the trainer composes them (docs/tensor_parallel.md).
//
// The plan changes a layer's parameters to its slice (set_data, so optimizers made afterwards and
// references to the module see the slice); the state dict then holds slices under the full
// layer's names, and gather_full_state() rebuilds the whole model's (for a checkpoint or
// model.pt). Every rank of the group holds the same weights before the plan (the slice is cut
// from them) and applies the same plan.

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "scaletrain/box.h"
#include "scaletrain/dist.h"

namespace scaletrain {

// ---- The operators (autograd functions over the tensor-parallel group) ------------------------

/// f: identity forward; the gradient is all-reduced (summed) over `tp` backward.
at::Tensor copy_to_region(const at::Tensor& x, const Dist& tp);
/// g: `x` all-reduced (summed) over `tp` forward; identity backward.
at::Tensor reduce_from_region(const at::Tensor& x, const Dist& tp);
/// Every rank's `x` concatenated along `dim`, by rank, forward; backward the gradient summed over
/// the ranks and this rank's slice kept (reduce-scatter). Sequence parallelism's f.
at::Tensor gather_from_sequence(const at::Tensor& x, const Dist& tp, int64_t dim);
/// The sum of every rank's `x`, of which this rank keeps its slice along `dim` forward
/// (reduce-scatter); backward the gradients' slices gathered (all-gather). Sequence parallelism's
/// g. Throws UsageError when `dim` does not split into tp.size() equal slices.
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const Dist& tp, int64_t dim);
/// This rank's slice of `x` along `dim` forward (no communication: every rank holds all of x);
/// backward the slices' gradients gathered. Where a replicated tensor enters a sharded region.
at::Tensor scatter_to_sequence(const at::Tensor& x, const Dist& tp, int64_t dim);
/// Every rank's `x` concatenated along `dim` forward; backward this rank's slice of the gradient
/// (no communication: every rank's gradient of the gathered tensor is the same).
at::Tensor gather_from_region(const at::Tensor& x, const Dist& tp, int64_t dim);

/// Cross entropy of logits whose last dimension (the vocabulary) is split over `tp`: this rank
/// holds classes [rank·V/tp, (rank+1)·V/tp) of `logits` [..., V/tp]; `targets` [...] hold global
/// class ids. No rank gathers the logits (three all-reduces of one number per token). Returns the
/// mean over the targets other than `ignore_index` (PyTorch's cross_entropy with reduction
/// "mean": NaN when every target is ignored), the same on every rank; its gradient flows to this
/// rank's logits. A target outside [0, V) (ignored ones aside) is an Error naming it.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const Dist& tp, int64_t ignore_index = -100);

// ---- The layers --------------------------------------------------------------------------------

/// How a layer is split (the plan's values; colwise(), rowwise(), vocab_parallel() make them).
struct ParallelStyle {
  enum class Kind {
    kReplicate,  // every rank holds the whole layer (no plan entry is the same)
    kColwise,    // Linear: output features split (weight rows, bias)
    kRowwise,    // Linear: input features split (weight columns; the bias added once, whole)
    kVocab,      // Embedding: rows (the vocabulary) split
  };
  Kind kind = Kind::kReplicate;
  /// Colwise: the output is `chunks` equal parts each split on its own (a fused q, k, v
  /// projection: 3), so that rank r holds the r-th slice of every part, in order.
  int64_t chunks = 1;
  /// Colwise: the input is this rank's slice of the sequence (along `sequence_dim`), gathered
  /// first; rowwise and vocab: the output is reduce-scattered along it instead of all-reduced.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;  // [batch, sequence, features]
  /// Colwise: the outputs gathered along the last dimension (every rank holds all of them);
  /// false (default): each rank keeps its slice, for the rowwise layer after it or a
  /// vocab-parallel loss.
  bool gather_output = false;
};
ParallelStyle colwise(int64_t chunks = 1, bool sequence_parallel = false);
ParallelStyle rowwise(bool sequence_parallel = false);
ParallelStyle vocab_parallel(bool sequence_parallel = false);

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in, int64_t out) : in_features(in), out_features(out) {}
  ParallelLinearOptions& bias(bool on) {
    with_bias = on;
    return *this;
  }
  int64_t in_features, out_features;
  bool with_bias = true;
};

/// torch::nn::Linear's parameters (weight [out, in], bias [out]), initialisation and function,
/// which a plan can split over a tensor-parallel group (ParallelStyle): then weight and bias hold
/// this rank's slice and forward() communicates as the style says.
class ParallelLinearImpl : public torch::nn::Cloneable<ParallelLinearImpl> {
 public:
  ParallelLinearImpl(int64_t in, int64_t out)
      : ParallelLinearImpl(ParallelLinearOptions(in, out)) {}
  explicit ParallelLinearImpl(const ParallelLinearOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  /// Splits the parameters (this rank's slice) and sets the style. Throws UsageError when the
  /// split features do not divide by tp.size() (naming the layer as `name`) or the style is not
  /// one of a Linear.
  void parallelize(const Dist& tp, const ParallelStyle& style, const std::string& name = "");
  const ParallelStyle& style() const { return style_; }

  ParallelLinearOptions options;
  at::Tensor weight, bias;

 private:
  ParallelStyle style_;
  std::shared_ptr<const Dist> tp_;
};
TORCH_MODULE(ParallelLinear);

/// torch::nn::Embedding's parameter (weight [num_embeddings, dim]), initialisation N(0, 1) and
/// function; a vocab_parallel() plan splits its rows (this rank's ids looked up, the others' zero,
/// summed over the ranks — or reduce-scattered along the sequence).
class ParallelEmbeddingImpl : public torch::nn::Cloneable<ParallelEmbeddingImpl> {
 public:
  ParallelEmbeddingImpl(int64_t num_embeddings, int64_t dim);
  void reset() override;
  at::Tensor forward(const at::Tensor& ids);
  void parallelize(const Dist& tp, const ParallelStyle& style, const std::string& name = "");
  const ParallelStyle& style() const { return style_; }
  /// The first id this rank holds (0 without a plan).
  int64_t first_id() const { return first_id_; }

  int64_t num_embeddings, dim;
  at::Tensor weight;

 private:
  ParallelStyle style_;
  std::shared_ptr<const Dist> tp_;
  int64_t first_id_ = 0;
};
TORCH_MODULE(ParallelEmbedding);

// ---- The plan ----------------------------------------------------------------------------------

/// Submodule names (as named_modules() gives them, "blocks.0.attn.qkv") to styles.
using TensorParallelPlan = std::map<std::string, ParallelStyle>;

/// Applies `plan` to `module`'s ParallelLinear and ParallelEmbedding submodules (see the top of
/// this header). With a sequence-parallel plan (an entry with sequence_parallel), it registers
/// sum_partial_gradients() on the parameters it leaves whole (replicated_parameters()). Throws
/// UsageError naming the entry for a name that is not a submodule, a submodule that is not a
/// ParallelLinear or ParallelEmbedding (the fix: declare it as one), a style that does not fit
/// it, or a size that does not divide by tp.size().
void parallelize_module(torch::nn::Module& module, const Dist& tp, const TensorParallelPlan& plan);

/// Registers sequence parallelism's sum on `params` (parameters whole on every rank, used on this
/// rank's slice of the sequence): from now on every backward sums each one's incoming gradient
/// over `tp` before it accumulates into .grad, so .grad is whole whatever reads it (Note [Partial
/// gradients summed in backward]). parallelize_module() calls it for a sequence-parallel plan;
/// call it only for such parameters of a module split by hand with the operators above. Every
/// rank of `tp` registers the same parameters and runs the same backward (each sum is a
/// collective). Registering a parameter again does nothing; a later plan that splits it turns
/// its sum off. Nothing for a group of one rank.
void sum_partial_gradients(const std::vector<at::Tensor>& params, const Dist& tp);

/// For a loop that ends each optimizer step in one place (train() does): the registered sums of
/// `params` in one flattened all-reduce per step instead of one all-reduce per parameter per
/// backward (Megatron-LM's way; at tp 2 on a small GPT on CPU processes, 1.76x the tokens/s).
/// From this call on their gradients accumulate unsummed, and the loop calls
/// sum_deferred_partial_gradients(params, tp) after each step's last backward, before anything
/// reads them (it commutes with DDP's average over dp, which may come first). Forgetting that
/// trains wrong weights: the safe default is not to defer.
void defer_partial_sums(const std::vector<at::Tensor>& params);
/// The deferred ones among `params`: their accumulated gradients summed over `tp` in one
/// all-reduce. Collective over `tp`; every rank passes the same parameters.
void sum_deferred_partial_gradients(const std::vector<at::Tensor>& params, const Dist& tp);

/// The explicit form of that sum, after the last backward of an optimizer step (with gradient
/// accumulation: once, over what the step accumulated, never after each batch): sums over `tp`
/// the gradients of those of `params` that carry no registered sum. Those that do (a plan's, or
/// sum_partial_gradients()'s) are whole already and left alone, so a program that still calls it
/// after a plan sums nothing twice.
void sync_sequence_parallel_grads(const std::vector<at::Tensor>& params, const Dist& tp);

/// The parameters of `module` that no plan entry split: with a sequence-parallel plan these are
/// the ones whose gradients the plan sums (a tensor-parallel model's replicated parameters
/// otherwise need nothing: every rank computes the same gradient).
std::vector<at::Tensor> replicated_parameters(torch::nn::Module& module);

/// The whole model's state dict, collective over `tp`: every split parameter gathered back into
/// its full shape (chunks in place), the rest as they are; keys are the module's own. A MoE
/// layer spread over an ep group (expert_parallel.h) is split too, along its experts' first
/// dimension over the layer's own group: this and the functions below are then collective over
/// that group as well. Every rank
/// gets it (CPU tensors). With `gradients`: the parameters' gradients instead, assembled the same
/// way (zeros where a parameter has none), buffers left out.
std::map<std::string, at::Tensor> gather_full_state(torch::nn::Module& module, const Dist& tp,
                                                    bool gradients = false);

/// The inverse of gather_full_state(): `state` (the whole model's, by the module's names) into
/// `module`, each split parameter taking its slice. Not collective. Throws UsageError naming a
/// parameter that `state` lacks or holds in another shape.
void load_full_state(torch::nn::Module& module, const Dist& tp,
                     const std::map<std::string, at::Tensor>& state);

/// This rank's slices of whole tensors shaped as `module`'s parameters (`whole`, by the module's
/// names: optimizer moments, say), each cut as load_full_state() cuts its parameter; names the
/// module lacks are left out. Not collective.
std::map<std::string, at::Tensor> slice_full_state(torch::nn::Module& module, const Dist& tp,
                                                   const std::map<std::string, at::Tensor>& whole);

/// The inverse of slice_full_state(), collective over `tp`: tensors shaped as this rank's slices
/// of `module`'s parameters (`slices`, by the module's names: optimizer moments, say), each split
/// one joined as gather_full_state() joins its parameter, the others as they are; names the
/// module lacks are left out. Every rank must give the same names, and gets the whole tensors,
/// on the CPU. Each is gathered where it is (NCCL: on the rank's device).
std::map<std::string, at::Tensor> gather_full_tensors(
    torch::nn::Module& module, const Dist& tp, const std::map<std::string, at::Tensor>& slices);

/// Where this rank's slice of a parameter lies in the whole one: a replicated parameter is one
/// piece, its whole self; a split one is a piece per chunk of its style (a fused q/k/v weight:
/// 3), each a box of the slice (`local`) placed at `global_offsets` of the whole parameter.
struct SlicePlacement {
  struct Piece {
    Box local;
    std::vector<int64_t> global_offsets;
  };
  std::vector<int64_t> whole_shape;
  std::vector<Piece> pieces;
};
/// Each of `module`'s parameters' placement, by the module's names (every rank of `tp` holds a
/// slice of the same shape). Not collective.
std::map<std::string, SlicePlacement> slice_placements(torch::nn::Module& module, const Dist& tp);

/// How a planned `module`'s parameters are cut: a line "name dim chunks" per split parameter.
/// What a checkpoint of slices keeps, so that join_slices() can put them back together where no
/// such module is built (a resume at another degree).
std::string describe_split(torch::nn::Module& module);
/// The whole tensors from every slice's (`slices[r]`: rank r's tensors of its group, by name;
/// `split`: describe_split()'s lines), each split one joined as gather_full_state() joins it,
/// the others taken from rank 0's. Not collective. Throws Error for a name a slice lacks.
std::map<std::string, at::Tensor> join_slices(
    const std::vector<std::map<std::string, at::Tensor>>& slices, const std::string& split);

}  // namespace scaletrain
