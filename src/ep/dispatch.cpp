// Token dispatch and combine for expert parallelism (expert_parallel.h).
//
// Note [Token dispatch]
// ~~~~~~~~~~~~~~~~~~~~~
// A rank holds T tokens, each routed to k experts: T · k slots. Dispatch sorts the slots by
// expert (a stable sort: within an expert, tokens keep their order), so that the slots bound for
// rank j, whose experts are [j · E/N, (j + 1) · E/N), lie together, in expert order. Two
// all-to-alls follow over the ep group:
//   1. the counts: each rank sends rank j its E/N counts of slots for j's experts, and learns how
//      many rows each rank will send it for each of its own experts (no rank sends what the other
//      did not expect: PyTorch's all_to_all_single needs both sides' splits);
//   2. the rows themselves, x's row of each slot (dim elements), with those splits.
// What arrives is ordered by (source rank, local expert); a permutation regroups it by (local
// expert, source rank), so that each local expert's rows are one block, its tokens in the global
// order of the ranks' batches (rank 0's first). Combine runs the same in reverse: the experts'
// output rows back to (source rank, local expert) order, one all-to-all home with the splits
// swapped, each slot weighted by its router weight and added into its token's row (index_add over
// the sorted slots: a token's k outputs are summed in expert order at every ep degree).
//
// Backward is the mirror: the gradient of an all-to-all is the all-to-all with its splits
// swapped, and the permutations and index_add are ATen's own differentiable operations. Nothing
// is dropped or padded: a rank whose experts receive no token gets empty blocks.

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>
#include <vector>

#include "scaletrain/error.h"
#include "scaletrain/expert_parallel.h"

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string str(int64_t v) { return std::to_string(v); }

struct Group : torch::CustomClassHolder {
  std::shared_ptr<const Dist> ep;
  ExpertTraffic* traffic = nullptr;
};

at::Tensor exchange(const Group& g, const at::Tensor& x, const std::vector<int64_t>& out_splits,
                    const std::vector<int64_t>& in_splits, const char* what) {
  if (g.traffic != nullptr) {
    g.traffic->exchanges += 1;
    int64_t away = 0;
    for (size_t j = 0; j < in_splits.size(); ++j) {
      if (static_cast<int>(j) != g.ep->rank()) away += in_splits[j];
    }
    g.traffic->rows_sent += away;
  }
  return g.ep->all_to_all_single(x.contiguous(), out_splits, in_splits, what);
}

// all_to_all_single as an autograd function: its gradient goes back with the splits swapped.
struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
                            c10::IValue held) {
    const Group& g = *static_cast<Group*>(held.toCapsule().get());
    ctx->saved_data["group"] = held;
    ctx->saved_data["out"] = c10::IValue(out_splits);
    ctx->saved_data["in"] = c10::IValue(in_splits);
    return exchange(g, x, out_splits, in_splits, "expert-parallel all-to-all of token rows");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const Group& g = *static_cast<Group*>(ctx->saved_data.at("group").toCapsule().get());
    const auto out = ctx->saved_data.at("out").toIntVector();
    const auto in = ctx->saved_data.at("in").toIntVector();
    return {exchange(g, grad[0], in, out, "expert-parallel all-to-all of row gradients"),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_to_all(const Dispatched& d, const at::Tensor& x, const std::vector<int64_t>& out,
                      const std::vector<int64_t>& in) {
  auto g = c10::make_intrusive<Group>();
  g->ep = d.ep;
  g->traffic = d.traffic;
  return AllToAll::apply(x, out, in, c10::IValue::make_capsule(std::move(g)));
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

void check_dispatch(const at::Tensor& x, const at::Tensor& ids, int64_t experts, int n) {
  if (x.dim() != 2 || ids.dim() != 2 || ids.size(0) != x.size(0)) {
    throw UsageError(
        "dispatch: x must be [tokens, dim] and expert_ids [tokens, k] with as many "
        "tokens; got x " +
        str(x.dim()) + "-D with " + str(x.dim() ? x.size(0) : 0) + " rows and expert_ids " +
        str(ids.dim()) + "-D; flatten the batch first");
  }
  if (ids.scalar_type() != at::kLong) {
    throw UsageError("dispatch: expert_ids must be int64 (at::kLong), as topk gives them");
  }
  if (experts < 1 || experts % n != 0) {
    throw UsageError("dispatch: " + str(experts) + " experts cannot be spread evenly over " +
                     str(n) +
                     " expert-parallel ranks; use a number of experts the ep degree "
                     "divides, or another ep degree");
  }
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    if (lo < 0 || hi >= experts) {
      throw UsageError("dispatch: expert id " + str(lo < 0 ? lo : hi) + " is outside [0, " +
                       str(experts) + "); the router's ids must index the layer's experts");
    }
  }
}

}  // namespace

Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, int64_t experts,
                    const Dist* ep, ExpertTraffic* traffic) {
  const int n = ep != nullptr ? ep->size() : 1;
  check_dispatch(x, expert_ids, experts, n);
  const int64_t k = expert_ids.size(1), local = experts / n;
  Dispatched d;
  d.traffic = traffic;
  const at::Tensor flat = expert_ids.reshape({-1});
  d.order = at::argsort(flat, /*stable=*/true);
  d.token_of = at::div(d.order, k, "floor");
  const at::Tensor sorted = x.index_select(0, d.token_of);
  const at::Tensor counts = at::bincount(flat, {}, experts);
  if (n == 1) {
    d.rows = sorted;
    d.rows_per_expert = to_vector(counts);
    return d;
  }
  d.ep = std::make_shared<const Dist>(*ep);
  // 1. The counts: rank j receives this rank's counts for its experts, and sends its own.
  const std::vector<int64_t> recv = to_vector(
      d.ep->all_to_all_single(counts.contiguous(), {}, {}, "expert-parallel all-to-all of counts"));
  if (traffic != nullptr) traffic->exchanges += 1;
  const std::vector<int64_t> mine = to_vector(counts);
  d.sent.assign(static_cast<size_t>(n), 0);
  d.received.assign(static_cast<size_t>(n), 0);
  for (int j = 0; j < n; ++j) {
    for (int64_t l = 0; l < local; ++l) {
      d.sent[static_cast<size_t>(j)] += mine[static_cast<size_t>(j * local + l)];
      d.received[static_cast<size_t>(j)] += recv[static_cast<size_t>(j * local + l)];
    }
  }
  // 2. The rows, arriving by (source rank, local expert); regrouped by (local expert, source).
  const at::Tensor arrived = all_to_all(d, sorted, d.received, d.sent);
  std::vector<int64_t> start(recv.size(), 0), perm;
  perm.reserve(static_cast<size_t>(arrived.size(0)));
  for (size_t i = 1; i < recv.size(); ++i) start[i] = start[i - 1] + recv[i - 1];
  d.rows_per_expert.assign(static_cast<size_t>(local), 0);
  for (int64_t l = 0; l < local; ++l) {
    for (int j = 0; j < n; ++j) {
      const size_t at = static_cast<size_t>(j * local + l);
      for (int64_t r = 0; r < recv[at]; ++r) perm.push_back(start[at] + r);
      d.rows_per_expert[static_cast<size_t>(l)] += recv[at];
    }
  }
  d.regroup = at::tensor(perm, at::kLong).to(x.device());
  d.rows = arrived.index_select(0, d.regroup);
  return d;
}

at::Tensor combine(const at::Tensor& outputs, const Dispatched& d, const at::Tensor& weights) {
  if (outputs.dim() != 2 || outputs.size(0) != d.rows.size(0) ||
      weights.numel() != d.order.numel()) {
    throw UsageError("combine: outputs must be [rows, dim] with dispatch()'s " +
                     str(d.rows.size(0)) + " rows, and weights [tokens, k] with its " +
                     str(d.order.numel()) + " slots; got " + str(outputs.size(0)) + " rows and " +
                     str(weights.numel()) + " weights");
  }
  at::Tensor back = outputs;
  if (d.ep) {
    // Back to (source rank, local expert) order, then home with the splits swapped.
    const at::Tensor undo = at::empty_like(d.regroup).scatter_(
        0, d.regroup, at::arange(d.regroup.numel(), d.regroup.options()));
    back = all_to_all(d, outputs.index_select(0, undo), d.sent, d.received);
  }
  const at::Tensor w =
      weights.reshape({-1}).index_select(0, d.order).to(back.scalar_type()).unsqueeze(1);
  return at::zeros({weights.size(0), back.size(1)}, back.options())
      .index_add(0, d.token_of, back * w);
}

}  // namespace scaletrain
