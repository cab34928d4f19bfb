#pragma once
// A stage's backward split in two (internal; Note [Split backward] in split_backward.cpp), for
// the zero-bubble schedules of both runners (pipeline.cpp, dist_pipeline.cpp).

#include <torch/csrc/autograd/edge.h>
#include <torch/nn/modules/container/sequential.h>

#include <vector>

namespace scaletrain {

class SplitStage {
 public:
  /// Remembers the stage's trainable parameters (those requiring gradients now).
  explicit SplitStage(const torch::nn::Sequential& stage);

  /// One micro-batch's graph: the stage's input and end until I (`out`: the stage's output; the
  /// caller may put the loss there, for the last stage), then where W starts and the gradients
  /// there, until W.
  struct Graph {
    at::Tensor in, out;
    std::vector<torch::autograd::Edge> roots;
    std::vector<at::Tensor> grads;
  };

  /// Forward of the stage on `input`; returns the output.
  at::Tensor forward(const at::Tensor& input, Graph& graph);
  /// I: from the gradient of the stage's end, the gradient of the stage's input — undefined
  /// when the input needs none — in one autograd pass that computes no weight gradient. Keeps
  /// what W needs of the graph and frees the rest.
  at::Tensor input_gradient(Graph& graph, const at::Tensor& grad) const;
  /// W: the parameters' gradients, accumulated into .grad, in one autograd pass; frees the graph.
  void weight_gradient(Graph& graph) const;

 private:
  torch::nn::Sequential stage_;
  std::vector<at::Tensor> trainable_;
};

}  // namespace scaletrain
