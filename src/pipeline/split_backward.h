#pragma once
// A stage's backward split in two (internal; Note [Split backward] in split_backward.cpp), for
// the zero-bubble schedules of both runners (pipeline.cpp, dist_pipeline.cpp).

#include <torch/csrc/autograd/edge.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace scaletrain {

class SplitStage {
 public:
  /// Groups the layers into pieces and remembers their trainable parameters (those requiring
  /// gradients now).
  explicit SplitStage(torch::nn::Sequential stage);

  /// One micro-batch's graph, described piece by piece (a weighted layer and the unweighted
  /// ones after it). The first piece holds the stage's input until I; the last one's `out`
  /// holds the stage's output until I (the caller may put the loss there, for the last stage).
  /// A piece with weights keeps where its W starts (its weighted layer's output), the sequence
  /// number of the layer's first autograd node and, after I, the gradient W starts from.
  struct Piece {
    at::Tensor in, out, grad;
    torch::autograd::Edge weighted;
    uint64_t first_node = 0;
  };
  using Graphs = std::vector<Piece>;

  /// Forward of the stage on `input` (one autograd graph); returns the output.
  at::Tensor forward(const at::Tensor& input, Graphs& graphs);
  /// I: from the gradient of the stage's end (its output, or the loss set as the last piece's
  /// out), the gradient of the stage's input — undefined when the input needs none — in one
  /// autograd pass. Keeps the weighted layers' part of the graph and the gradients at their
  /// outputs, for W; frees the rest.
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
