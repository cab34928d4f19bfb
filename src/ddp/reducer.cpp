// Note [Reducer]: the gradient side of DDP.
//
// Each parameter's gradient lives in a slice of one flat bucket tensor (its .grad is a view of
// that slice), so accumulation writes straight into the bucket. A post-hook on the parameter's
// AccumulateGrad node fires once its gradient is complete for this backward; when every
// parameter of a bucket has fired, the bucket is averaged and its all-reduce starts,
// asynchronously, while autograd goes on with earlier layers. Buckets are launched strictly in
// their index order, on every rank, so that collectives match across ranks even when hooks
// fire in different orders. At the end of backward a callback queued on the autograd engine
// waits for the all-reduces, so the gradients are averaged when backward() returns.
//
//   backward:  layer N .. layer 1
//   hooks:     p9 p8 | p7 p6 p5 | p4 ... p1
//   buckets:   [  0  ][    1   ][   2   ]      all-reduce k starts when bucket k is full
//   wire:          ===0===  ===1===  ===2===  finalize: wait, unpack, (unused map)
//
// If optimizer.zero_grad() dropped the views (set_to_none), the hook copies the fresh gradient
// into its slice and points .grad at the slice again.

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <thread>

#include "ddp/reducer.h"
#include "scaletrain/error.h"

namespace scaletrain {

using Reducer = DistributedDataParallel::Reducer;

Reducer::Reducer(Dist d, DDPOptions o, std::vector<at::Tensor> ps, std::vector<std::string> ns)
    : dist(std::move(d)),
      opts(o),
      params(std::move(ps)),
      names(std::move(ns)),
      divisor(dist.size()) {
  std::vector<BucketParam> specs;
  for (auto& p : params) {
    specs.push_back({static_cast<int64_t>(p.numel() * p.element_size()),
                     std::string(c10::toString(p.scalar_type())) + "@" + p.device().str()});
  }
  BucketOptions bo;
  bo.first_cap_bytes = static_cast<int64_t>(opts.first_bucket_cap_mb * 1024 * 1024);
  bo.cap_bytes = static_cast<int64_t>(opts.bucket_cap_mb * 1024 * 1024);
  assignment = assign_buckets(specs, bo);

  bucket_of.assign(params.size(), 0);
  views.resize(params.size());
  for (size_t k = 0; k < assignment.size(); ++k) {
    Bucket b;
    int64_t numel = 0;
    for (size_t i : assignment[k]) numel += params[i].numel();
    const auto& first = params[assignment[k].front()];
    b.flat = at::zeros({numel}, first.options().requires_grad(false));
    int64_t offset = 0;
    for (size_t i : assignment[k]) {
      bucket_of[i] = k;
      // An alias of the bucket's storage, not an autograd view: LibTorch's
      // Optimizer::zero_grad() calls detach_() on gradients, which views refuse.
      views[i] = at::empty({0}, b.flat.options());
      views[i].set_(b.flat.storage(), offset, params[i].sizes(), params[i].strides());
      offset += params[i].numel();
      if (opts.gradient_as_bucket_view) params[i].mutable_grad() = views[i];
    }
    buckets.push_back(std::move(b));
  }
  ready.assign(params.size(), false);
  used.assign(params.size(), true);

  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    if (!acc) {
      throw Error("DDP: parameter '" + names[i] +
                  "' has no gradient accumulator; is it a leaf "
                  "tensor with requires_grad?");
    }
    auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_gradient(i);
          return outputs;
        }));
    hooks.push_back({acc, key});
  }
}

Reducer::~Reducer() {
  for (auto& [acc, key] : hooks) acc->del_post_hook(key);
}

void Reducer::attach(size_t i) {
  // Make .grad the bucket slice again, carrying over what autograd just put there.
  auto& g = params[i].mutable_grad();
  if (!g.defined()) return;
  if (g.data_ptr() != views[i].data_ptr()) {
    views[i].copy_(g);
    if (opts.gradient_as_bucket_view) g = views[i];
  }
}

void Reducer::prepare(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu);
  if (expecting) {
    throw Error("rank " + std::to_string(dist.rank()) +
                ": DDP forward called again before the last forward's backward finished "
                "reducing gradients; run backward() after every DDP forward (or evaluate "
                "under torch::NoGradGuard without DDP)");
  }
  if (!sync) return;  // no_sync: gradients only accumulate
  bool differentiable = false;
  for (auto& out : outputs) differentiable |= out.defined() && out.requires_grad();
  if (!differentiable) return;  // evaluation (no grad): no backward will follow
  ++round;
  std::fill(ready.begin(), ready.end(), false);
  for (size_t k = 0; k < buckets.size(); ++k) {
    buckets[k].pending = assignment[k].size();
    buckets[k].launched = false;
    buckets[k].work = Pending();
  }
  next_launch = 0;
  callback_queued = false;
  expecting = true;
  if (!opts.find_unused_parameters) return;

  // Trace the graph back from the outputs; parameters whose accumulator is not reached get no
  // gradient in this backward and count as ready now.
  std::set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (auto& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    for (auto& e : n->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    used[i] = seen.count(hooks[i].first.get()) > 0;
    if (!used[i]) {
      auto& g = params[i].mutable_grad();
      if (g.defined() && g.data_ptr() != views[i].data_ptr()) g = views[i];
      views[i].zero_();
      mark_ready(i);
    }
  }
}

void Reducer::on_gradient(size_t i) {
  std::lock_guard<std::mutex> lock(mu);
  attach(i);
  if (!expecting) {
    if (!sync) return;  // inside no_sync(): gradients accumulate locally
    // Note [Armed backward] in ddp.h: no DDP step started this backward.
    throw Error("rank " + std::to_string(dist.rank()) + ": DDP: the gradient of '" + names[i] +
                "' was computed in a backward that no DDP step started: the module was called "
                "directly (model->forward(x)) instead of through DDP, so this rank's gradients "
                "would not be averaged and the replicas would drift apart. Call it through DDP "
                "(ddp(x), or ddp.forward([&] { return model->forward(...); })); for outputs "
                "computed elsewhere call ddp.prepare_for_backward(outputs) before backward; a "
                "backward meant to stay local goes inside ddp.no_sync().");
  }
  if (!callback_queued) {
    callback_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  mark_ready(i);
}

void Reducer::mark_ready(size_t i) {
  if (ready[i]) return;
  ready[i] = true;
  Bucket& b = buckets[bucket_of[i]];
  if (--b.pending == 0 && opts.overlap) {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      launch(next_launch++);
    }
  }
}

void Reducer::launch(size_t k) {
  Bucket& b = buckets[k];
  b.launched = true;
  // A world of one with nothing to compress: the mean over one rank is its own gradient, the
  // same bits, so no kernel and no collective (on a GPU, the step of a small model is bounded
  // by what the host launches).
  if (dist.size() == 1 && divisor == 1 && opts.comm_hook == CommHook::kNone) return;
  b.flat.div_(divisor);
  if (opts.comm_hook != CommHook::kNone) {
    b.wire = b.flat.to(opts.comm_hook == CommHook::kFp16 ? at::kHalf : at::kBFloat16);
  }
  b.work = comm->all_reduce_sum(b.wire.defined() ? b.wire : b.flat,
                                "all-reduce of gradient bucket " + std::to_string(k) + " of " +
                                    std::to_string(buckets.size()));
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mu);
  expecting = false;
  std::vector<size_t> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!ready[i]) missing.push_back(i);
  }
  if (!missing.empty()) report_missing(missing);
  for (size_t k = 0; k < buckets.size(); ++k) {
    if (!buckets[k].launched) launch(k);  // overlap off, or launched late
  }
  for (size_t k = 0; k < buckets.size(); ++k) {
    Bucket& b = buckets[k];
    b.work.wait();  // complete already on the shared-memory path
    if (b.wire.defined()) {
      b.flat.copy_(b.wire);
      b.wire = at::Tensor();
    }
  }
  if (!opts.gradient_as_bucket_view) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto& g = params[i].mutable_grad();
      if (g.defined())
        g.copy_(views[i]);
      else
        g = views[i].clone();
    }
  }
  if (opts.find_unused_parameters) drop_globally_unused();
}

std::vector<int32_t> Reducer::exchange_flags(int32_t mine, const std::string& what) {
  return comm->all_gather_flags(mine, what);
}

void Reducer::open_collectives(int instance) {
  // CPU ranks on one machine: the segment carries the float32 buckets (with a compression hook
  // they cross as 16-bit tensors, through the backend) and the uneven-input flags.
  int64_t largest = 0;
  bool cpu = false;
  for (auto& b : buckets) {
    cpu |= b.flat.is_cpu();
    if (b.flat.is_cpu() && b.flat.scalar_type() == at::kFloat && opts.comm_hook == CommHook::kNone)
      largest = std::max(largest, b.flat.numel());
  }
  CollectivesOptions co;
  co.shared_memory = opts.shared_memory && cpu;
  co.hierarchical = opts.hierarchical;
  co.chunk_floats = std::clamp<int64_t>(largest, 1, int64_t{1} << 20);  // <= 4 MB per rank
  comm = make_collectives(dist, co, "scaletrain/ddp/shm/" + std::to_string(instance));
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mu);
  for (size_t k = 0; k < buckets.size(); ++k) {
    const Bucket& b = buckets[k];
    const std::string what = "all-reduce of gradient bucket " + std::to_string(k) + " of " +
                             std::to_string(buckets.size()) + " (shadowed by a joined rank)";
    // The same dtype as the ranks that step put on the wire: the same path.
    auto zeros = at::zeros_like(
        b.flat, opts.comm_hook == CommHook::kNone
                    ? b.flat.scalar_type()
                    : (opts.comm_hook == CommHook::kFp16 ? at::kHalf : at::kBFloat16));
    comm->all_reduce_sum(zeros, what).wait();
  }
  if (opts.find_unused_parameters) {
    auto t = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
    dist.all_reduce(t, ReduceOp::SUM, "all-reduce of the used-parameter map (shadowed)");
  }
}

void Reducer::drop_globally_unused() {
  // Parameters no rank used keep no gradient, as in a single process: an optimizer then skips
  // them (weight decay and momentum included).
  auto map = at::empty({static_cast<int64_t>(params.size())}, at::kInt);
  for (size_t i = 0; i < params.size(); ++i) map[static_cast<int64_t>(i)] = used[i] ? 1 : 0;
  dist.all_reduce(map, ReduceOp::SUM, "all-reduce of the used-parameter map");
  auto acc = map.accessor<int, 1>();
  for (size_t i = 0; i < params.size(); ++i) {
    if (acc[static_cast<int64_t>(i)] == 0) params[i].mutable_grad() = at::Tensor();
  }
}

void Reducer::report_missing(const std::vector<size_t>& missing) {
  // Publish this rank's list in the store, give the other ranks a moment to publish theirs
  // (they usually hit the same problem in the same step), and name them all.
  std::string mine;
  for (size_t i : missing) mine += (mine.empty() ? "" : ", ") + names[i];
  const std::string prefix = "scaletrain/ddp/missing/" + std::to_string(round) + "/";
  std::string lists;
  try {
    dist.store_set(prefix + std::to_string(dist.rank()), mine);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (int r = 0; r < dist.size(); ++r) {
      std::string key = prefix + std::to_string(r);
      while (!dist.store_check(key) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (dist.store_check(key)) {
        lists += "\n  rank " + std::to_string(r) + ": " + dist.store_get(key);
      }
    }
    // Rank 0 serves the store: let the others finish reading before it goes away.
    dist.store_add(prefix + "read", 1);
    while (dist.rank() == 0 && dist.store_add(prefix + "read", 0) < dist.size() &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store is gone (rank 0 already failed): report what this rank knows.
    if (lists.find("rank " + std::to_string(dist.rank()) + ":") == std::string::npos) {
      lists += "\n  rank " + std::to_string(dist.rank()) + ": " + mine;
    }
  }
  throw Error(
      "DDP: parameters received no gradient in this backward, so their buckets cannot be "
      "all-reduced. Parameters without gradient, per rank:" +
      lists +
      "\nIf parts of the model are legitimately unused in some steps, construct "
      "DistributedDataParallel with DDPOptions::find_unused_parameters = true; otherwise make "
      "sure every parameter contributes to the loss.");
}

}  // namespace scaletrain
