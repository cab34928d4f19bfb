// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward into I (the gradient of the stage's input,
// which the previous stage waits for) and W (its weights' gradients, which nobody waits for).
// The stage's layers fall in pieces: a layer with weights and the layers without weights that
// follow it (a Linear and its Tanh), and the layers without weights before the first such
// layer. Forward records, for each weighted layer, its output's autograd edge and the sequence
// number of the first node it creates (autograd numbers a thread's nodes in creation order).
// I is one autograd pass from the stage's end to its input that asks only for the input's
// gradient (so no weight gradient is computed) and captures, on its way, the gradient at each
// weighted layer's output. I then cuts the graph: in each weighted layer's part (the nodes its
// output reaches), an edge to a node created before the layer (the previous layer, whose input
// gradient I has computed) is removed, and every node outside those parts is freed, as a whole
// backward frees it (a Tanh's saved output, a dropout's mask). The weighted layers' parts are
// now disjoint, so W runs them all in one pass, from their outputs' captured gradients into
// their parameters. A stage costs two autograd passes instead of one. Between layers nothing is
// computed twice; but a layer whose weights sit at several depths (a residual block, a
// transformer layer) is one part, and W goes again through the gradients of its inner
// activations that I computed. The gradients are one whole backward's, bit for bit for a chain
// of layers (the same operations on the same values).
//
// Memory. What W adds over 1F1B is each weighted layer's output gradient, from I to W (an
// activation-sized tensor per weighted layer), and what the weighted layers' own backward
// functions saved (a Linear's input, which 1F1B's B frees at B).

#include "pipeline/split_backward.h"

#include <ATen/SequenceNumber.h>
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

using torch::autograd::Edge;
using torch::autograd::Node;

// After I: the weighted layers' parts of the graph (what each weighted output reaches without
// going back past the layer's first node) are kept for W, and the edges out of them cut; every
// other node reachable from the stage's end is freed (Note [Split backward]).
void keep_only_weighted_parts(const Edge& end, const SplitStage::Graphs& graphs) {
  std::unordered_set<Node*> kept;
  std::vector<std::pair<Node*, size_t>> cuts;
  std::vector<Node*> stack;
  for (const auto& piece : graphs) {
    if (!piece.grad.defined()) continue;
    stack.push_back(piece.weighted.function.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (n == nullptr || !kept.insert(n).second) continue;
      for (size_t i = 0; i < n->num_outputs(); ++i) {
        Node* next = n->next_edge(i).function.get();
        if (next == nullptr) continue;
        if (next->sequence_nr() < piece.first_node) {
          cuts.emplace_back(n, i);  // into an earlier layer: I's part
        } else {
          stack.push_back(next);
        }
      }
    }
  }
  std::unordered_set<Node*> seen;
  stack.push_back(end.function.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    if (kept.count(n) == 0) n->release_variables();
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  // (set_next_edge would update the node's topological number, which autograd forbids once
  // the node has parents; an edge removed leaves it an upper bound, as autograd needs.)
  for (const auto& [n, i] : cuts) n->next_edges()[i] = Edge();
}

}  // namespace

at::Tensor SplitStage::forward(const at::Tensor& input, Graphs& graphs) {
  graphs.assign(pieces_.size(), Piece{});
  graphs.front().in = input;
  at::Tensor h = input;
  for (size_t p = 0; p < pieces_.size(); ++p) {
    for (size_t l : pieces_[p]) {
      const uint64_t first_node = at::sequence_number::peek();
      h = layers_[l].forward(h);
      if (l == pieces_[p].front() && !trainable_[p].empty() && h.grad_fn()) {
        graphs[p].weighted = torch::autograd::impl::gradient_edge(h);
        graphs[p].first_node = first_node;
      }
    }
  }
  graphs.back().out = h;
  return h;
}

at::Tensor SplitStage::input_gradient(Graphs& graphs, const at::Tensor& grad) const {
  const at::Tensor in = std::move(graphs.front().in), end = std::move(graphs.back().out);
  if (!end.defined() || !end.requires_grad()) return at::Tensor();
  const bool wants_input = in.requires_grad();
  torch::autograd::edge_list outputs;
  if (wants_input) outputs.push_back(torch::autograd::impl::gradient_edge(in));
  std::vector<size_t> weighted;  // pieces whose W starts at a captured gradient
  for (size_t p = 0; p < graphs.size(); ++p) {
    if (graphs[p].weighted.is_valid()) {
      outputs.push_back(graphs[p].weighted);
      weighted.push_back(p);
    }
  }
  if (outputs.empty()) return at::Tensor();
  const Edge root = torch::autograd::impl::gradient_edge(end);
  auto got = torch::autograd::Engine::get_default_engine().execute(
      {root}, {grad}, /*keep_graph=*/!weighted.empty(), /*create_graph=*/false,
      /*accumulate_grad=*/false, outputs);
  const size_t first = wants_input ? 1 : 0;
  for (size_t j = 0; j < weighted.size(); ++j) graphs[weighted[j]].grad = got[first + j];
  if (!weighted.empty()) keep_only_weighted_parts(root, graphs);
  if (!wants_input) return at::Tensor();
  return got[0].defined() ? got[0] : at::zeros_like(in);
}

void SplitStage::weight_gradient(Graphs& graphs) const {
  // The weighted layers' parts of the graph are disjoint after I: one pass runs all of them.
  torch::autograd::edge_list roots, into;  // into: the parameters' gradient accumulators
  std::vector<at::Tensor> grads;
  for (size_t p = 0; p < graphs.size(); ++p) {
    if (!graphs[p].grad.defined()) continue;
    roots.push_back(graphs[p].weighted);
    grads.push_back(graphs[p].grad);
    for (const auto& t : trainable_[p]) into.push_back(torch::autograd::impl::gradient_edge(t));
  }
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(
        roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true, into);
  }
  graphs.clear();
}

}  // namespace scaletrain
