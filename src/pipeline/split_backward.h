#pragma once
// A stage's backward split in two (internal; Note [Split backward] in split_backward.cpp), for
// the zero-bubble schedules of both runners (pipeline.cpp, dist_pipeline.cpp).

#include <torch/nn/modules/container/sequential.h>

#include <vector>

namespace scaletrain {

class SplitStage {
 public:
  /// Remembers each layer's trainable parameters (those requiring gradients now).
  explicit SplitStage(torch::nn::Sequential stage);

  /// One micro-batch's graphs: each layer's input, output (the loss for the last layer of the
  /// last stage) and, after I, the output's gradient.
  struct Piece {
    at::Tensor in, out, grad;
  };
  using Graphs = std::vector<Piece>;

  /// Forward of the stage on `input`, each layer on a graph of its own; returns the output.
  at::Tensor forward(const at::Tensor& input, Graphs& graphs);
  /// I: from the gradient of the stage's end (its output, or the loss set as the last piece's
  /// out), the gradient of the stage's input — undefined when the input needs none. Keeps the
  /// graphs and, for layers with parameters, their output gradients for W.
  at::Tensor input_gradient(Graphs& graphs, const at::Tensor& grad) const;
  /// W: the parameters' gradients, accumulated into .grad; frees the graphs.
  void weight_gradient(Graphs& graphs) const;

 private:
  torch::nn::Sequential stage_;
  std::vector<std::vector<at::Tensor>> trainable_;  // per layer
};

}  // namespace scaletrain
