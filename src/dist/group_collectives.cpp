// Dist's collectives, point-to-point transfers and store (dist.h): each a c10d call on the
// group's backend or store, waited for with the group's timeout and wait_for's errors.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cstring>

#include "dist/text.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

std::string described(const std::string& what, const std::string& op, const at::Tensor& t) {
  return what.empty() ? op + " of a " + c10::str(t.sizes()) + " tensor" : what;
}

std::string or_else(const std::string& what, const std::string& otherwise) {
  return what.empty() ? otherwise : what;
}

void check_peer(const Dist& d, int peer, const std::string& op) {
  if (peer < 0 || peer >= d.size()) {
    throw UsageError(op + " with rank " + std::to_string(peer) + " from rank " +
                     std::to_string(d.rank()) + ": the group has ranks 0-" +
                     std::to_string(d.size() - 1));
  }
}

}  // namespace

Pending Dist::all_reduce_async(at::Tensor& tensor, ReduceOp op, const std::string& what) const {
  std::vector<at::Tensor> t{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  return Pending(backend->allreduce(t, o), described(what, "all_reduce", tensor), *this);
}

void Dist::all_reduce(at::Tensor& tensor, ReduceOp op, const std::string& what) const {
  all_reduce_async(tensor, op, what).wait();
}

void Dist::broadcast(at::Tensor& tensor, int src, const std::string& what) const {
  if (src < 0 || src >= size()) {
    throw UsageError("broadcast from rank " + std::to_string(src) + ": the group has ranks 0-" +
                     std::to_string(size() - 1));
  }
  std::vector<at::Tensor> t{tensor};
  c10d::BroadcastOptions o;
  o.rootRank = src;
  wait_for(backend->broadcast(t, o), or_else(what, "broadcast from rank " + std::to_string(src)),
           *this);
}

std::vector<at::Tensor> Dist::all_gather(const at::Tensor& tensor, const std::string& what) const {
  std::vector<at::Tensor> in{tensor};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < size(); ++r) out[0].push_back(at::empty_like(tensor));
  wait_for(backend->allgather(out, in), described(what, "all_gather", tensor), *this);
  return out[0];
}

at::Tensor Dist::all_gather_into_tensor(const at::Tensor& tensor, const std::string& what) const {
  auto shape = tensor.sizes().vec();
  if (shape.empty()) shape.push_back(1);
  shape[0] *= size();
  auto out = at::empty(shape, tensor.options());
  auto in = tensor.contiguous();
  all_gather_into_tensor_async(out, in, described(what, "all_gather_into_tensor", tensor)).wait();
  return out;
}

Pending Dist::all_gather_into_tensor_async(at::Tensor& out, const at::Tensor& input,
                                           const std::string& what) const {
  auto in = input;  // c10d takes it by reference
  return Pending(backend->_allgather_base(out, in),
                 described(what, "all_gather_into_tensor", input), *this);
}

at::Tensor Dist::reduce_scatter_tensor(const at::Tensor& input, ReduceOp op,
                                       const std::string& what) const {
  if (input.dim() == 0 || input.size(0) % size() != 0) {
    throw UsageError("reduce_scatter_tensor: dimension 0 of a " + c10::str(input.sizes()) +
                     " tensor does not split into " + std::to_string(size()) +
                     " equal slices; pad it to a multiple of the world size");
  }
  auto shape = input.sizes().vec();
  shape[0] /= size();
  auto out = at::empty(shape, input.options());
  reduce_scatter_tensor_async(out, input.contiguous(), op,
                              described(what, "reduce_scatter_tensor", input))
      .wait();
  return out;
}

Pending Dist::reduce_scatter_tensor_async(at::Tensor& out, const at::Tensor& input, ReduceOp op,
                                          const std::string& what) const {
  auto in = input;  // c10d takes it by reference
  c10d::ReduceScatterOptions o;
  o.reduceOp = op;
  return Pending(backend->_reduce_scatter_base(out, in, o),
                 described(what, "reduce_scatter_tensor", input), *this);
}

void Dist::barrier(const std::string& what) const {
  wait_for(backend->barrier(), or_else(what, "barrier"), *this);
}

namespace {

// A split of `rows` over the group: the one given (checked), or equal parts.
std::vector<int64_t> checked_splits(const std::vector<int64_t>& given, int64_t rows, int ranks,
                                    const std::string& which) {
  if (given.empty()) {
    if (rows % ranks != 0) {
      throw UsageError("all_to_all_single: " + std::to_string(rows) + " rows of " + which +
                       " do not split into " + std::to_string(ranks) +
                       " equal parts; give the splits");
    }
    return std::vector<int64_t>(static_cast<size_t>(ranks), rows / ranks);
  }
  int64_t sum = 0;
  for (int64_t n : given) {
    if (n < 0) throw UsageError("all_to_all_single: a negative split in " + which);
    sum += n;
  }
  if (static_cast<int>(given.size()) != ranks || (rows >= 0 && sum != rows)) {
    throw UsageError("all_to_all_single: " + which + " splits " + std::to_string(given.size()) +
                     " ways, " + std::to_string(sum) + " rows in all, for " +
                     std::to_string(ranks) + " ranks" +
                     (rows >= 0 ? " and " + std::to_string(rows) + " rows" : std::string()) +
                     "; give one count per rank, adding up to the rows");
  }
  return given;
}

}  // namespace

at::Tensor Dist::all_to_all_single(const at::Tensor& input,
                                   const std::vector<int64_t>& output_splits,
                                   const std::vector<int64_t>& input_splits,
                                   const std::string& what) const {
  if (input.dim() < 1) throw UsageError("all_to_all_single: the input needs a dimension 0");
  auto in_splits = checked_splits(input_splits, input.size(0), size(), "the input's");
  auto out_splits = checked_splits(output_splits, output_splits.empty() ? input.size(0) : -1,
                                   size(), "the output's");
  int64_t out_rows = 0;
  for (int64_t n : out_splits) out_rows += n;
  auto sizes = input.sizes().vec();
  sizes[0] = out_rows;
  at::Tensor out = at::empty(sizes, input.options());
  at::Tensor in = input.contiguous();
  c10d::AllToAllOptions o;
  wait_for(backend->alltoall_base(out, in, out_splits, in_splits, o),
           described(what, "all_to_all_single", input), *this);
  return out;
}

Pending Dist::isend(const at::Tensor& tensor, int dst, int tag, const std::string& what) const {
  check_peer(*this, dst, "send");
  std::vector<at::Tensor> t{tensor};
  return Pending(backend->send(t, dst, tag), or_else(what, "send to rank " + std::to_string(dst)),
                 *this);
}

Pending Dist::irecv(at::Tensor& tensor, int src, int tag, const std::string& what) const {
  check_peer(*this, src, "recv");
  std::vector<at::Tensor> t{tensor};
  return Pending(backend->recv(t, src, tag),
                 or_else(what, "receive from rank " + std::to_string(src)), *this);
}

void Dist::send(const at::Tensor& tensor, int dst, int tag, const std::string& what) const {
  isend(tensor, dst, tag, what).wait();
}

void Dist::recv(at::Tensor& tensor, int src, int tag, const std::string& what) const {
  irecv(tensor, src, tag, what).wait();
}

int64_t Dist::store_add(const std::string& key, int64_t by) const { return store->add(key, by); }

void Dist::store_set(const std::string& key, const std::string& value) const {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Dist::store_get(const std::string& key) const {
  const auto v = store->get(key);
  return std::string(v.begin(), v.end());
}

bool Dist::store_check(const std::string& key) const { return store->check({key}); }

std::string dist_text::broadcast_text(const Dist& d, const std::string& mine,
                                      const std::string& what) {
  if (d.size() == 1) return mine;
  const at::Device dev = d.backend_name == "nccl" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  auto n = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(dev);
  d.broadcast(n, 0, what + "'s length");
  const int64_t len = n.cpu().item<int64_t>();
  auto t = at::zeros({len}, at::kByte);
  if (d.rank() == 0) std::memcpy(t.data_ptr(), mine.data(), mine.size());
  t = t.to(dev);
  d.broadcast(t, 0, what);
  t = t.cpu();
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(len));
}

}  // namespace scaletrain
