// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward into I (the gradient of the stage's input,
// which the previous stage waits for) and W (its weights' gradients, which nobody waits for).
// Autograd computes a graph's gradients in one pass, so the stage runs in pieces, each on a
// graph of its own (its input detached from the previous piece's output): a piece is a layer
// with weights and the layers without weights that follow it (a Linear and its Tanh), and the
// layers without weights before the first such layer. I walks the pieces from the last, asking
// each graph for its input's gradient and, on the way, for the gradient of its weighted layer's
// output, keeping the graphs of pieces with weights; W then asks all of those graphs at once
// (one engine call: they are disjoint) for their parameters' gradients, starting at the weighted
// layers' outputs. So W goes through no layer without weights again (a residual block's inner
// activations aside), and nothing is computed twice. The gradients are those of one whole
// backward, bit for bit for a chain of layers (the same operations on the same values).
//
// Memory. A whole backward frees what no backward function saved as soon as forward moves on
// (a Linear's output, which the following Tanh does not save); pieces must not keep such tensors
// alive until W: a piece's input is the previous piece's output (shared storage), so a Linear
// and its Tanh in one piece hold only what their backward functions saved, and a piece keeps
// its graph's root (an autograd edge), not its output tensor, and drops its input after I. What
// the layers after the weighted one saved (a Tanh's output, a dropout's mask) is freed at I, as
// in a whole backward (but in a first stage's first piece, whose I has nothing to compute: W
// starts at its end). What W adds over 1F1B is each weighted layer's output gradient, from I to
// W (an activation-sized tensor per weighted layer).
//
// A piece gets its input as a leaf of its own graph, so a piece whose first operation writes its
// input in place (an in-place ReLU as the first layer of a stage) is refused by autograd under
// these schedules: make it out of place.

#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_set>
#include <utility>

namespace scaletrain {

SplitStage::SplitStage(torch::nn::Sequential stage) : stage_(std::move(stage)) {
  for (const auto& any : *stage_) layers_.push_back(any);
  size_t l = 0;
  for (const auto& layer : stage_->children()) {
    std::vector<at::Tensor> trainable;
    for (auto& t : layer->parameters()) {
      if (t.requires_grad()) trainable.push_back(t);
    }
    // A layer with weights starts a piece; one without joins the piece before it.
    if (pieces_.empty() || !trainable.empty()) {
      pieces_.emplace_back();
      trainable_.emplace_back();
    }
    pieces_.back().push_back(l++);
    trainable_.back().insert(trainable_.back().end(), trainable.begin(), trainable.end());
  }
}

namespace {

// The piece keeps its graph's root, not the output tensor (Note [Split backward]).
void keep_root_only(SplitStage::Piece& piece) {
  if (!piece.out.defined()) return;
  piece.differentiable = piece.out.requires_grad();
  if (piece.differentiable) piece.root = torch::autograd::impl::gradient_edge(piece.out);
  piece.out = at::Tensor();
}

// After I captured W's gradient at the weighted layer's output: what the layers after it saved
// (a Tanh's output, a dropout's mask) is freed now, as a whole backward would, not at W. Only
// nodes W does not reach are released.
void release_above(const SplitStage::Piece& piece) {
  using torch::autograd::Node;
  std::unordered_set<Node*> below;  // W's part of the graph
  std::vector<Node*> stack{piece.weighted.function.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (n == nullptr || !below.insert(n).second) continue;
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  std::unordered_set<Node*> seen;
  stack.push_back(piece.root.function.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (n == nullptr || below.count(n) != 0 || !seen.insert(n).second) continue;
    n->release_variables();
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
}

}  // namespace

at::Tensor SplitStage::forward(const at::Tensor& input, Graphs& graphs) {
  graphs.clear();
  at::Tensor h = input;
  for (const auto& layers : pieces_) {
    if (!graphs.empty()) keep_root_only(graphs.back());
    at::Tensor in = graphs.empty() ? h : h.detach().requires_grad_(h.requires_grad());
    h = in;
    Piece piece;
    for (size_t l : layers) {
      h = layers_[l].forward(h);
      // The weighted layer's output, where W starts when layers without weights follow it.
      const bool weighted_output = l == layers.front() && layers.size() > 1 &&
                                   !trainable_[graphs.size()].empty() && h.grad_fn();
      if (weighted_output) piece.weighted = torch::autograd::impl::gradient_edge(h);
    }
    piece.in = in;
    piece.out = h;
    graphs.push_back(std::move(piece));
  }
  return h;
}

at::Tensor SplitStage::input_gradient(Graphs& graphs, const at::Tensor& grad) const {
  auto& engine = torch::autograd::Engine::get_default_engine();
  at::Tensor g = grad;
  for (size_t l = graphs.size(); l-- > 0;) {
    auto& piece = graphs[l];
    keep_root_only(piece);  // the last piece's output (or loss), no longer needed as such
    const bool weighted = !trainable_[l].empty();
    const bool wants_input = piece.differentiable && piece.in.requires_grad();
    // W starts at the weighted layer's output, its gradient captured on the way, when I runs
    // through the piece; else at the piece's end (a stage's first piece: no input gradient).
    const bool capture = weighted && wants_input && piece.weighted.is_valid();
    if (weighted && !capture) {
      piece.weighted = piece.root;
      piece.grad = g;
    }
    if (!wants_input) return at::Tensor();
    torch::autograd::edge_list outputs{torch::autograd::impl::gradient_edge(piece.in)};
    if (capture) outputs.push_back(piece.weighted);
    // Only W's layers (those with weights) keep their graph; the others' is freed here.
    auto got = engine.execute({piece.root}, {g}, /*keep_graph=*/weighted, /*create_graph=*/false,
                              /*accumulate_grad=*/false, outputs);
    if (capture) {
      piece.grad = got[1];
      release_above(piece);
    }
    g = got[0].defined() ? got[0] : at::zeros_like(piece.in);
    piece.in = at::Tensor();  // W does not read it (what it needs, its graph saved)
  }
  return g;
}

void SplitStage::weight_gradient(Graphs& graphs) const {
  // The pieces' graphs are disjoint (each starts from a detached input): one engine call runs
  // all of their W.
  torch::autograd::edge_list roots, into;  // into: the parameters' gradient accumulators
  std::vector<at::Tensor> grads;
  for (size_t l = 0; l < graphs.size(); ++l) {
    auto& piece = graphs[l];
    if (trainable_[l].empty() || !piece.grad.defined() || !piece.differentiable) continue;
    roots.push_back(piece.weighted);
    grads.push_back(piece.grad);
    for (const auto& p : trainable_[l]) into.push_back(torch::autograd::impl::gradient_edge(p));
  }
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(
        roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true, into);
  }
  graphs.clear();
}

}  // namespace scaletrain
