#pragma once
// A stage's backward split in two (internal; Note [Split backward] in split_backward.cpp), for
// the zero-bubble schedules of both runners (pipeline.cpp, dist_pipeline.cpp).

#include <torch/csrc/autograd/edge.h>
#include <torch/nn/modules/container/sequential.h>

#include <vector>

namespace scaletrain {

class SplitStage {
 public:
  /// Groups the layers into pieces and remembers their trainable parameters (those requiring
  /// gradients now).
  explicit SplitStage(torch::nn::Sequential stage);

  /// One micro-batch's graphs, a piece each (a weighted layer and the unweighted ones after it):
  /// its input, the root of its graph and, after I, the root's gradient. `out` holds the
  /// stage's output on the last piece until I (the caller may put the loss there, for the last
  /// stage); other pieces keep only their graph's root.
  struct Piece {
    at::Tensor in, out, grad;
    torch::autograd::Edge root;
    // Where W starts: the weighted layer's output when layers without weights follow it in
    // the piece (I captures its gradient there), else the root; `grad` is W's gradient there.
    torch::autograd::Edge weighted;
    bool differentiable = false;
  };
  using Graphs = std::vector<Piece>;

  /// Forward of the stage on `input`, each piece on a graph of its own; returns the output.
  at::Tensor forward(const at::Tensor& input, Graphs& graphs);
  /// I: from the gradient of the stage's end (its output, or the loss set as the last piece's
  /// out), the gradient of the stage's input — undefined when the input needs none. Keeps the
  /// graphs of the pieces with parameters and the gradients where their W starts.
  at::Tensor input_gradient(Graphs& graphs, const at::Tensor& grad) const;
  /// W: the parameters' gradients, accumulated into .grad; frees the graphs.
  void weight_gradient(Graphs& graphs) const;

 private:
  torch::nn::Sequential stage_;
  std::vector<torch::nn::AnyModule> layers_;
  std::vector<std::vector<size_t>> pieces_;         // layer indices (Note [Split backward])
  std::vector<std::vector<at::Tensor>> trainable_;  // per piece
};

}  // namespace scaletrain
