// Note [Asynchronous checkpoints]
// save() takes a snapshot that nothing in the training can change afterwards, and a thread
// serialises and writes it. The model's parameters and buffers and TrainingState's tensors are
// copied onto the CPU (a copy even where they are on the CPU already: the optimizer updates
// them in place). The optimizer's state is held by the optimizer under its parameters' TensorImpl
// pointers, and its serialisation names them by those pointers; so the snapshot is a stand-in
// optimizer of the same kind and options, over stand-in parameters (empty tensors, one per
// parameter in the same groups and order) that hold copies of the state. Loading maps the saved
// state onto the loading optimizer's parameters by their place in the groups, not by pointer, so
// the stand-in's file loads as the original's would. Optimizers of other kinds are serialised
// within save() (the payload is the snapshot), which is correct and only slower.
//
// The writer is one std::thread per checkpoint, joined by the next save() or wait(): there is
// never more than one write in flight, and a checkpoint is on disk before the next one starts,
// so pruning (which keeps the newest `keep`) never races a write.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <mutex>
#include <thread>

#include "checkpoint/checkpoint_dcp.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/optimizer_state.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/log.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

at::Tensor copy_to_cpu(const at::Tensor& t) {
  return t.defined() ? t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : t;
}

NamedTensors copied(const NamedTensors& from) {
  NamedTensors out;
  out.reserve(from.size());
  for (const auto& [name, t] : from) out.emplace_back(name, copy_to_cpu(t));
  return out;
}

template <typename Opt, typename Options>
std::unique_ptr<torch::optim::Optimizer> stand_in_of(const torch::optim::Optimizer& opt) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<std::pair<at::Tensor, ParamState>> states;
  for (const auto& group : opt.param_groups()) {
    std::vector<at::Tensor> params;
    for (const auto& p : group.params()) {
      params.push_back(at::empty({0}));
      if (auto st = param_state(opt, p)) {
        for (auto& [name, t] : st->tensors) t = copy_to_cpu(t);
        states.emplace_back(params.back(), std::move(*st));
      }
    }
    groups.emplace_back(std::move(params), group.options().clone());
  }
  auto out = std::make_unique<Opt>(groups, static_cast<const Options&>(opt.defaults()));
  for (const auto& [p, st] : states) set_param_state(*out, p, st);
  return out;
}

// A stand-in optimizer holding copies of `opt`'s state (Note [Asynchronous checkpoints]), or
// null for a kind this cannot copy.
std::unique_ptr<torch::optim::Optimizer> stand_in_of(const torch::optim::Optimizer& opt) {
  const auto kind = optimizer_kind(opt);
  if (kind == "adamw") return stand_in_of<torch::optim::AdamW, torch::optim::AdamWOptions>(opt);
  if (kind == "adam") return stand_in_of<torch::optim::Adam, torch::optim::AdamOptions>(opt);
  if (kind == "sgd") return stand_in_of<torch::optim::SGD, torch::optim::SGDOptions>(opt);
  return nullptr;
}

}  // namespace

struct AsyncCheckpointer::Impl {
  AsyncCheckpointOptions options;
  std::thread writer;
  mutable std::mutex mu;  // guards the fields below, which the writer sets
  std::exception_ptr error;
  std::string last_written;
  Timing timing;

  void join() {
    if (writer.joinable()) writer.join();
  }

  // Records the snapshot's timing and starts the write: `write` returns the path written; what
  // it throws is kept for the next wait(), and the write's time is set either way.
  void start(const Timing& taken, std::function<std::string()> write) {
    {
      std::lock_guard<std::mutex> lock(mu);
      timing = taken;
    }
    writer = std::thread([this, write = std::move(write)] {
      const auto start = Clock::now();
      try {
        auto path = write();
        std::lock_guard<std::mutex> lock(mu);
        last_written = std::move(path);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      timing.write = std::max(seconds_since(start), 1e-9);
    });
  }
};

AsyncCheckpointer::AsyncCheckpointer(AsyncCheckpointOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    log_line(LogLevel::kWarning, e.what());
  }
}

void AsyncCheckpointer::wait() {
  impl_->join();
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    std::swap(error, impl_->error);
  }
  if (error) std::rethrow_exception(error);
}

bool AsyncCheckpointer::busy() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->writer.joinable() && impl_->timing.write == 0;
}

std::string AsyncCheckpointer::last_written() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last_written;
}

AsyncCheckpointer::Timing AsyncCheckpointer::timing() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->timing;
}

std::string AsyncCheckpointer::save(const std::string& dir, const TrainingState& state,
                                    const torch::nn::Module& model,
                                    const torch::optim::Optimizer* opt, int keep) {
  check_run_id(state.run_id);
  auto t0 = Clock::now();
  wait();
  Timing timing;
  timing.waited = seconds_since(t0);
  t0 = Clock::now();
  if (impl_->options.layout == CheckpointLayout::kDcp) {
    return save_folder(dir, state, model, opt, keep, timing, t0);
  }
  // The snapshot: nothing the training does from here on reaches it.
  auto s = std::make_shared<TrainingState>(state);
  for (auto& [name, t] : s->tensors) t = copy_to_cpu(t);
  auto params = std::make_shared<NamedTensors>(copied(named_parameters_of(model)));
  auto buffers = std::make_shared<NamedTensors>(copied(named_buffers_of(model)));
  std::shared_ptr<torch::optim::Optimizer> stand_in = opt ? stand_in_of(*opt) : nullptr;
  std::shared_ptr<std::string> payload;
  if (opt != nullptr && !stand_in) {
    payload = std::make_shared<std::string>(checkpoint_payload(*s, *params, *buffers, opt));
  }
  timing.snapshot = seconds_since(t0);
  impl_->start(timing, [this, dir, keep, s, params, buffers, stand_in, payload] {
    if (impl_->options.before_serialize) {
      impl_->options.before_serialize(checkpoint_path(dir, s->global_step));
    }
    const std::string body =
        payload ? *payload : checkpoint_payload(*s, *params, *buffers, stand_in.get());
    return commit_checkpoint(dir, s->global_step, s->run_id, body, keep,
                             impl_->options.before_rename);
  });
  return checkpoint_path(dir, state.global_step);
}

// save() of a folder (CheckpointLayout::kDcp): the snapshot is the folder's keys and values,
// every tensor a copy on the CPU (the optimizer's state under its parameters' names needs no
// stand-in).
std::string AsyncCheckpointer::save_folder(const std::string& dir, const TrainingState& state,
                                           const torch::nn::Module& model,
                                           const torch::optim::Optimizer* opt, int keep,
                                           Timing timing,
                                           std::chrono::steady_clock::time_point t0) {
  auto snapshot = std::make_shared<DcpState>(checkpoint_dcp_state(state, model, opt));
  for (auto& box : snapshot->tensors) box.tensor = copy_to_cpu(box.tensor);
  timing.snapshot = seconds_since(t0);
  const int64_t step = state.global_step;
  const std::string run_id = state.run_id;
  impl_->start(timing, [this, dir, keep, snapshot, step, run_id] {
    if (impl_->options.before_serialize) {
      impl_->options.before_serialize(dcp_checkpoint_path(dir, step));
    }
    return commit_dcp_checkpoint(dir, step, run_id, *snapshot, keep, impl_->options.before_rename);
  });
  return dcp_checkpoint_path(dir, step);
}

}  // namespace scaletrain
