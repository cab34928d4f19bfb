// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward into I (the gradient of the stage's input,
// which the previous stage waits for) and W (its weights' gradients, which nobody waits for),
// operation by operation, as the zero-bubble paper does. The stage's forward is one autograd
// graph. Before I, a walk of the graph from the stage's end finds the nodes on a path to the
// stage's input (I's nodes) and, among them, the weight nodes: those with an edge out of I's
// nodes towards a trainable parameter (a Linear's addmm, towards its weight and bias; a layer
// norm; a product with a weight). I is one autograd pass that asks only for the input's
// gradient, so no weight gradient is computed, and captures on its way the gradients arriving
// at every weight node. Then each weight node's edges into I's nodes are cut, and every node
// outside W's part (the weight nodes and what they reach) is freed, as a whole backward frees
// it (a Tanh's saved output, an attention's probabilities, a dropout's mask). W is one autograd
// pass from the weight nodes, with the gradients I captured, into the parameters: only the
// weights' own gradients, nothing of I computed again. The gradients are one whole backward's,
// bit for bit for a chain of layers (the same operations on the same values). A stage whose
// input needs no gradient (the model's first) has nothing for I: W is its whole backward.
//
// Memory. What W keeps over 1F1B, from I to W, is what the weight nodes saved (a Linear's
// input, which 1F1B's B frees at B) and the gradient at each of them (an activation-sized
// tensor per weight operation).

#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace scaletrain {

SplitStage::SplitStage(const torch::nn::Sequential& stage) : stage_(stage) {
  for (auto& t : stage_->parameters()) {
    if (t.requires_grad()) trainable_.push_back(t);
  }
}

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;

// What a node reaches: the stage's input (I's nodes), a trainable parameter.
enum Reach : unsigned char { kInput = 1, kTrainable = 2 };

// Every node reachable from `root`, with what it reaches (post-order, without recursion).
std::unordered_map<Node*, unsigned char> reach_of(Node* root, Node* input,
                                                  const std::unordered_set<Node*>& params) {
  std::unordered_map<Node*, unsigned char> reach;
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  reach[root] = 0;
  while (!stack.empty()) {
    auto& [n, next] = stack.back();
    if (next < n->num_outputs()) {
      Node* child = n->next_edge(next++).function.get();
      if (child != nullptr && reach.emplace(child, 0).second) stack.emplace_back(child, 0);
      continue;
    }
    unsigned char r = (n == input ? kInput : 0) | (params.count(n) != 0 ? kTrainable : 0);
    for (const auto& e : n->next_edges()) {
      if (e.function) r |= reach.at(e.function.get());
    }
    reach[n] = r;
    stack.pop_back();
  }
  return reach;
}

// A node of I's with an edge out of I's nodes towards a trainable parameter.
bool weight_node(Node* n, const std::unordered_map<Node*, unsigned char>& reach) {
  if ((reach.at(n) & kInput) == 0) return false;
  for (const auto& e : n->next_edges()) {
    if (!e.function) continue;
    const unsigned char r = reach.at(e.function.get());
    if ((r & kInput) == 0 && (r & kTrainable) != 0) return true;
  }
  return false;
}

// After I: frees every node W does not reach (from the weight nodes, not into I's nodes), then
// cuts the weight nodes' edges into I's nodes.
void keep_only_w(const std::vector<Node*>& weight_nodes,
                 const std::unordered_map<Node*, unsigned char>& reach) {
  std::unordered_set<Node*> kept(weight_nodes.begin(), weight_nodes.end());
  std::vector<Node*> stack;
  for (Node* n : weight_nodes) {
    for (const auto& e : n->next_edges()) {
      if (e.function && (reach.at(e.function.get()) & kInput) == 0) {
        stack.push_back(e.function.get());
      }
    }
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!kept.insert(n).second) continue;
    for (const auto& e : n->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  for (const auto& [n, r] : reach) {
    if (kept.count(n) == 0) n->release_variables();
  }
  // (set_next_edge would update the node's topological number, which autograd forbids once
  // the node has parents; an edge removed leaves it an upper bound, as autograd needs.)
  for (Node* n : weight_nodes) {
    for (auto& e : n->next_edges()) {
      if (e.function && (reach.at(e.function.get()) & kInput) != 0) e = Edge();
    }
  }
}

}  // namespace

at::Tensor SplitStage::forward(const at::Tensor& input, Graph& graph) {
  graph = Graph{};
  graph.in = input;
  graph.out = stage_->forward(input);
  return graph.out;
}

at::Tensor SplitStage::input_gradient(Graph& graph, const at::Tensor& grad) const {
  const at::Tensor in = std::move(graph.in), end = std::move(graph.out);
  if (!end.defined() || !end.requires_grad()) return at::Tensor();
  const Edge root = torch::autograd::impl::gradient_edge(end);
  const bool wants_input = in.requires_grad();
  const Edge input = wants_input ? torch::autograd::impl::gradient_edge(in) : Edge();
  std::unordered_set<Node*> params;
  for (const auto& p : trainable_)
    params.insert(torch::autograd::impl::gradient_edge(p).function.get());
  const auto reach = reach_of(root.function.get(), input.function.get(), params);
  if ((reach.at(root.function.get()) & kInput) == 0) {
    // Nothing of the graph leads to the input: W is the whole backward.
    graph.roots = {root};
    graph.grads = {grad};
    return wants_input ? at::zeros_like(in) : at::Tensor();
  }
  std::vector<Node*> weight_nodes;
  torch::autograd::edge_list outputs{input};
  for (const auto& [n, r] : reach) {
    if (!weight_node(n, reach)) continue;
    weight_nodes.push_back(n);
    for (uint32_t i = 0; i < n->num_inputs(); ++i) {
      outputs.emplace_back(n->getptr(), i);
    }
  }
  auto got = torch::autograd::Engine::get_default_engine().execute(
      {root}, {grad}, /*keep_graph=*/!weight_nodes.empty(), /*create_graph=*/false,
      /*accumulate_grad=*/false, outputs);
  for (size_t k = 1; k < outputs.size(); ++k) {
    graph.roots.push_back(outputs[k]);
    graph.grads.push_back(got[k]);
  }
  if (!weight_nodes.empty()) keep_only_w(weight_nodes, reach);
  return got[0].defined() ? got[0] : at::zeros_like(in);
}

void SplitStage::weight_gradient(Graph& graph) const {
  bool any = false;
  for (const auto& g : graph.grads) any = any || g.defined();
  if (any) {
    torch::autograd::edge_list into;  // the parameters' gradient accumulators
    for (const auto& p : trainable_) into.push_back(torch::autograd::impl::gradient_edge(p));
    torch::autograd::Engine::get_default_engine().execute(
        graph.roots, graph.grads, /*keep_graph=*/false, /*create_graph=*/false,
        /*accumulate_grad=*/true, into);
  }
  graph = Graph{};
}

}  // namespace scaletrain
