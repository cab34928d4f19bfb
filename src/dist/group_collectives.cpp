// Dist's collectives (dist.h): each a c10d call on the group's backend, waited for with the
// group's timeout and wait_for's errors.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"

namespace scaletrain {

void Dist::all_reduce(at::Tensor& tensor, c10d::ReduceOp op) const {
  std::vector<at::Tensor> t{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  wait_for(backend->allreduce(t, o), "all_reduce of a " + c10::str(tensor.sizes()) + " tensor",
           *this);
}

void Dist::broadcast(at::Tensor& tensor, int src) const {
  if (src < 0 || src >= size()) {
    throw UsageError("broadcast from rank " + std::to_string(src) + ": the group has ranks 0-" +
                     std::to_string(size() - 1));
  }
  std::vector<at::Tensor> t{tensor};
  c10d::BroadcastOptions o;
  o.rootRank = src;
  wait_for(backend->broadcast(t, o), "broadcast from rank " + std::to_string(src), *this);
}

std::vector<at::Tensor> Dist::all_gather(const at::Tensor& tensor) const {
  std::vector<at::Tensor> in{tensor};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < size(); ++r) out[0].push_back(at::empty_like(tensor));
  wait_for(backend->allgather(out, in), "all_gather of a " + c10::str(tensor.sizes()) + " tensor",
           *this);
  return out[0];
}

at::Tensor Dist::all_gather_into_tensor(const at::Tensor& tensor) const {
  auto shape = tensor.sizes().vec();
  if (shape.empty()) shape.push_back(1);
  shape[0] *= size();
  auto out = at::empty(shape, tensor.options());
  auto in = tensor.contiguous();
  wait_for(backend->_allgather_base(out, in),
           "all_gather_into_tensor of a " + c10::str(tensor.sizes()) + " tensor", *this);
  return out;
}

at::Tensor Dist::reduce_scatter_tensor(const at::Tensor& input, c10d::ReduceOp op) const {
  if (input.dim() == 0 || input.size(0) % size() != 0) {
    throw UsageError("reduce_scatter_tensor: dimension 0 of a " + c10::str(input.sizes()) +
                     " tensor does not split into " + std::to_string(size()) +
                     " equal slices; pad it to a multiple of the world size");
  }
  auto shape = input.sizes().vec();
  shape[0] /= size();
  auto out = at::empty(shape, input.options());
  auto in = input.contiguous();
  c10d::ReduceScatterOptions o;
  o.reduceOp = op;
  wait_for(backend->_reduce_scatter_base(out, in, o),
           "reduce_scatter_tensor of a " + c10::str(input.sizes()) + " tensor", *this);
  return out;
}

void Dist::barrier() const { wait_for(backend->barrier(), "barrier", *this); }

}  // namespace scaletrain
