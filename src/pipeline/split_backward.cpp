// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward into I (the gradient of the stage's input,
// which the previous stage waits for) and W (its weights' gradients, which nobody waits for).
// Autograd computes a graph's gradients in one pass, so the stage runs in pieces, each on a
// graph of its own (its input detached from the previous piece's output): a piece is a layer
// with weights and the layers without weights that follow it (a Linear and its Tanh), and the
// layers without weights before the first such layer. I walks the pieces from the last, asking
// each graph for its input's gradient only, keeping the graphs of pieces with weights; W then
// asks each of those for its parameters' gradients, from the output gradient I kept. Within a
// piece, W goes through the layers after the weighted one (and a residual block's inner
// activations) again; between pieces nothing is computed twice. The gradients are those of one
// whole backward; only their rounding order may differ.
//
// Memory. A whole backward frees what no backward function saved as soon as forward moves on
// (a Linear's output, which the following Tanh does not save); pieces must not keep such tensors
// alive until W: a piece's input is the previous piece's output (shared storage), so a Linear
// and its Tanh in one piece hold only what their backward functions saved, and a piece keeps
// its graph's root (an autograd edge), not its output tensor, and drops its input after I. What
// W adds over 1F1B is each weighted piece's output gradient, from I to W (an activation-sized
// tensor per weighted layer), and what the piece's graph saved for its unweighted layers (a
// Tanh's output, a dropout's mask), which a whole backward would free at B.
//
// A piece gets its input as a leaf of its own graph, so a piece whose first operation writes its
// input in place (an in-place ReLU as the first layer of a stage) is refused by autograd under
// these schedules: make it out of place.

#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

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

}  // namespace

at::Tensor SplitStage::forward(const at::Tensor& input, Graphs& graphs) {
  graphs.clear();
  at::Tensor h = input;
  for (const auto& layers : pieces_) {
    if (!graphs.empty()) keep_root_only(graphs.back());
    at::Tensor in = graphs.empty() ? h : h.detach().requires_grad_(h.requires_grad());
    h = in;
    for (size_t l : layers) h = layers_[l].forward(h);
    Piece piece;
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
    if (!trainable_[l].empty()) piece.grad = g;  // W's start; none for layers without weights
    if (!piece.differentiable || !piece.in.requires_grad()) return at::Tensor();
    // Only W's layers (those with weights) keep their graph; the others' is freed here.
    g = engine.execute({piece.root}, {g}, /*keep_graph=*/!trainable_[l].empty(),
                       /*create_graph=*/false, /*accumulate_grad=*/false,
                       {torch::autograd::impl::gradient_edge(piece.in)})[0];
    if (!g.defined()) g = at::zeros_like(piece.in);
    piece.in = at::Tensor();  // W does not read it (what it needs, its graph saved)
  }
  return g;
}

void SplitStage::weight_gradient(Graphs& graphs) const {
  auto& engine = torch::autograd::Engine::get_default_engine();
  for (size_t l = 0; l < graphs.size(); ++l) {
    const auto& params = trainable_[l];
    auto& piece = graphs[l];
    if (params.empty() || !piece.grad.defined() || !piece.differentiable) continue;
    torch::autograd::edge_list into;  // the parameters' gradient accumulators
    for (const auto& p : params) into.push_back(torch::autograd::impl::gradient_edge(p));
    engine.execute({piece.root}, {piece.grad}, /*keep_graph=*/false, /*create_graph=*/false,
                   /*accumulate_grad=*/true, into);
  }
  graphs.clear();
}

}  // namespace scaletrain
