// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward into I (the gradient of the stage's input,
// which the previous stage waits for) and W (its weights' gradients, which nobody waits for).
// Autograd computes a graph's gradients in one pass, so the stage runs each of its layers on a
// graph of its own (the layer's input detached from the previous layer's output): I walks the
// layers from the last, asking each graph for its input's gradient only and keeping the graph;
// W then asks each graph for its parameters' gradients from the output gradient I kept (kept
// only for layers with parameters). Within one layer (a residual block, say), W goes through
// the layer's inner activations again; between layers nothing is computed twice. The gradients
// are those of one whole backward; only their rounding order may differ. A layer gets its
// input as a leaf of its own graph, so a layer whose first operation writes its input in place
// (an in-place ReLU as a layer of its own) is refused by autograd under these schedules: make
// it out of place.

#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/autograd.h>

#include <utility>

namespace scaletrain {

SplitStage::SplitStage(torch::nn::Sequential stage) : stage_(std::move(stage)) {
  for (const auto& layer : stage_->children()) {
    std::vector<at::Tensor> trainable;
    for (auto& t : layer->parameters()) {
      if (t.requires_grad()) trainable.push_back(t);
    }
    trainable_.push_back(trainable);
  }
}

at::Tensor SplitStage::forward(const at::Tensor& input, Graphs& graphs) {
  graphs.clear();
  at::Tensor h = input;
  for (auto& layer : *stage_) {
    at::Tensor in = graphs.empty() ? h : h.detach().requires_grad_(h.requires_grad());
    h = layer.forward(in);
    graphs.push_back({in, h, at::Tensor()});
  }
  return h;
}

at::Tensor SplitStage::input_gradient(Graphs& graphs, const at::Tensor& grad) const {
  at::Tensor g = grad;
  for (size_t l = graphs.size(); l-- > 0;) {
    auto& piece = graphs[l];
    if (!trainable_[l].empty()) piece.grad = g;  // W's start; none for layers without weights
    if (!piece.out.requires_grad() || !piece.in.requires_grad()) return at::Tensor();
    // Only W's layers (those with weights) keep their graph; the others' is freed here.
    g = torch::autograd::grad({piece.out}, {piece.in}, {g},
                              /*retain_graph=*/!trainable_[l].empty(), /*create_graph=*/false,
                              /*allow_unused=*/true)[0];
    if (!g.defined()) g = at::zeros_like(piece.in);
  }
  return g;
}

void SplitStage::weight_gradient(Graphs& graphs) const {
  for (size_t l = 0; l < graphs.size(); ++l) {
    const auto& params = trainable_[l];
    if (params.empty() || !graphs[l].grad.defined() || !graphs[l].out.requires_grad()) continue;
    torch::autograd::backward({graphs[l].out}, {graphs[l].grad}, /*keep_graph=*/false,
                              /*create_graph=*/false, params);
  }
  graphs.clear();
}

}  // namespace scaletrain
