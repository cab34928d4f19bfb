#include "scaletrain/pipeline.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "pipeline/split_backward.h"
#include "scaletrain/error.h"
#include "scaletrain/schedule.h"

namespace scaletrain {

std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int chunks) {
  if (chunks < 1) throw UsageError("chunks must be at least 1, got " + std::to_string(chunks));
  const int64_t n = batch.size(0);
  const int64_t k = std::min<int64_t>(chunks, std::max<int64_t>(n, 1));
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t len = n / k + (i < n % k ? 1 : 0);
    out.push_back(batch.narrow(0, start, len));
    start += len;
  }
  return out;
}

PipelineOptions place_by_memory(const torch::nn::Sequential& model,
                                const std::vector<DeviceBudget>& budgets, std::string* report) {
  std::vector<int64_t> bytes, counts;
  for (const auto& layer : model->children()) {
    int64_t b = 0, n = 0;
    for (const auto& t : layer->parameters()) b += static_cast<int64_t>(t.nbytes()), n += t.numel();
    for (const auto& t : layer->buffers()) b += static_cast<int64_t>(t.nbytes());
    bytes.push_back(b);
    counts.push_back(n);
  }
  const Placement placed = place_layers(bytes, budgets);
  PipelineOptions o;
  o.balance = placed.balance;
  for (const auto& d : placed.devices) o.devices.emplace_back(d);
  if (report != nullptr) {
    std::istringstream lines(placed.report());
    std::string line;
    size_t layer = 0;
    report->clear();
    for (size_t s = 0; std::getline(lines, line); ++s) {
      int64_t params = 0;
      for (int i = 0; i < placed.balance[s]; ++i) params += counts[layer++];
      *report += line + ", " + std::to_string(params) + " parameters\n";
    }
  }
  return o;
}

int Pipeline::chunks_for(int64_t batch) const {
  if (options_.split_size <= 0) return options_.chunks;
  return static_cast<int>(
      std::max<int64_t>(1, (batch + options_.split_size - 1) / options_.split_size));
}

std::vector<LayerProfile> profile_layers(const torch::nn::Sequential& model,
                                         const at::Tensor& sample, int repeats) {
  if (repeats < 1) throw UsageError("profile_layers needs at least one repeat");
  using Clock = std::chrono::steady_clock;
  std::vector<LayerProfile> out(model->size());
  size_t k = 0;
  for (const auto& layer : model->children()) {
    for (const auto& t : layer->parameters())
      out[k].parameter_bytes += static_cast<int64_t>(t.nbytes());
    for (const auto& t : layer->buffers())
      out[k].parameter_bytes += static_cast<int64_t>(t.nbytes());
    ++k;
  }
  std::vector<torch::nn::AnyModule> layers(model->begin(), model->end());
  for (int r = 0; r <= repeats; ++r) {  // the first pass warms up and is not counted
    at::Tensor h = sample;
    for (size_t i = 0; i < layers.size(); ++i) {
      // Each layer on its own graph: its backward is timed alone.
      at::Tensor in = h.detach().requires_grad_(h.is_floating_point());
      auto t0 = Clock::now();
      at::Tensor y = layers[i].forward(in);
      double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      if (y.requires_grad()) {
        auto grad = at::ones_like(y);
        t0 = Clock::now();
        y.backward(grad);
        secs += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      if (r > 0) {
        // The fastest repeat: an interruption by another process only ever adds time.
        out[i].seconds = r == 1 ? secs : std::min(out[i].seconds, secs);
        out[i].activation_bytes = static_cast<int64_t>(y.nbytes());
      }
      h = y.detach();
    }
  }
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();  // leave no trace
  return out;
}

std::vector<int> balance_by_time(const torch::nn::Sequential& model, const at::Tensor& sample,
                                 int stages, int repeats) {
  std::vector<double> costs;
  for (const auto& p : profile_layers(model, sample, repeats)) costs.push_back(p.seconds);
  return balance_by_cost(costs, stages);
}

std::vector<int> balance_by_size(const torch::nn::Sequential& model, int stages) {
  std::vector<double> costs;
  for (const auto& layer : model->children()) {
    double b = 0;
    for (const auto& t : layer->parameters()) b += static_cast<double>(t.nbytes());
    costs.push_back(b);
  }
  return balance_by_cost(costs, stages);
}

Pipeline::Pipeline(torch::nn::Sequential model, PipelineOptions options)
    : options_(std::move(options)) {
  const auto stages = options_.balance.size();
  if (stages > 1 && model->size() < stages) {
    throw UsageError(
        "a pipeline of " + std::to_string(stages) + " stages needs a Sequential of at least " +
        std::to_string(stages) + " blocks, and this one holds " + std::to_string(model->size()) +
        ": a pipeline splits a chain of blocks between stages, never inside one module. Give the "
        "model as a chain (scaletrain::Block in blocks.h: a block per layer or group of layers, "
        "sharing the model's own submodules; check_chain() verifies it), or as_sequential() for "
        "the zoo's models");
  }
  int total = 0;
  for (int b : options_.balance) {
    if (b < 1) throw UsageError("every stage of the balance needs at least one layer");
    total += b;
  }
  if (total != static_cast<int>(model->size())) {
    throw UsageError("the balance covers " + std::to_string(total) + " layers but the model has " +
                     std::to_string(model->size()));
  }
  const int v = options_.stages_per_device;
  if (v < 1) throw UsageError("stages_per_device must be at least 1, got " + std::to_string(v));
  if (v > 1 && options_.schedule != PipelineSchedule::kInterleaved1F1B) {
    throw UsageError("stages_per_device " + std::to_string(v) +
                     " is for the interleaved 1F1B schedule; set schedule to kInterleaved1F1B or "
                     "stages_per_device to 1");
  }
  if (options_.devices.size() * static_cast<size_t>(v) != options_.balance.size()) {
    throw UsageError("pipeline has " + std::to_string(options_.balance.size()) + " stages but " +
                     std::to_string(options_.devices.size()) + " devices of " + std::to_string(v) +
                     " stage(s) each; give one device per " + std::to_string(v) + " stage(s)");
  }
  std::vector<torch::nn::AnyModule> layers(model->begin(), model->end());
  size_t layer = 0;
  for (size_t s = 0; s < options_.balance.size(); ++s) {
    torch::nn::Sequential stage;
    for (int i = 0; i < options_.balance[s]; ++i) stage->push_back(layers[layer++]);
    stage->to(options_.devices[s % options_.devices.size()]);
    stages_.push_back(stage);
  }
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

at::Tensor Pipeline::forward(const at::Tensor& input) {
  const size_t p = options_.devices.size();
  std::vector<at::Tensor> outs;
  for (auto& mb : split_microbatches(input, chunks_for(input.size(0)))) {
    at::Tensor h = mb;
    for (size_t k = 0; k < stages_.size(); ++k) {
      h = stages_[k]->forward(h.to(options_.devices[k % p]));
    }
    outs.push_back(h);
  }
  return at::cat(outs);
}

// Note [Stage threads]: one thread per device, started at the first step and kept for the
// pipeline's life, runs its column of the schedule in order, waiting only for its data — a
// forward for the previous stage's forward, a backward for the next stage's input gradient —
// not for a whole tick. A slow task (a backward costs about two forwards) then delays only what
// depends on it. A thread that finds its data missing spins for a few microseconds before it
// sleeps: on a machine with a core per stage, a micro-batch handed over by the neighbour is
// usually there by then, and a sleeping thread takes tens of microseconds to wake.
class StageThreads {
 public:
  explicit StageThreads(const std::vector<at::Device>& devices) {
    errors_.resize(devices.size());
    for (size_t d = 0; d < devices.size(); ++d) {
      threads_.emplace_back([this, d, device = devices[d]] { loop(d, device); });
    }
  }
  ~StageThreads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }
  StageThreads(const StageThreads&) = delete;
  StageThreads& operator=(const StageThreads&) = delete;

  /// Runs job(d) on device d's thread, for every device; returns each one's exception, if any.
  std::vector<std::exception_ptr> run(const std::function<void(size_t)>& job) {
    std::unique_lock lock(mu_);
    job_ = &job;
    finished_ = 0;
    for (auto& e : errors_) e = nullptr;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return finished_ == threads_.size(); });
    job_ = nullptr;
    return errors_;
  }

 private:
  void loop(size_t d, at::Device device) {
#ifdef SCALETRAIN_WITH_CUDA
    // Each CUDA device's stages work on a stream of their own, so two on one GPU overlap.
    std::optional<c10::cuda::CUDAStreamGuard> stream;
    if (device.is_cuda()) stream.emplace(c10::cuda::getStreamFromPool(false, device.index()));
#else
    (void)device;
#endif
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(size_t)>* job = nullptr;
      {
        std::unique_lock lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      // The process's intra-op setting as it is now (a new thread starts with OpenMP's
      // default team, every core: stages would oversubscribe them).
      at::init_num_threads();
      std::exception_ptr error;
      try {
        (*job)(d);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(mu_);
        errors_[d] = error;
        ++finished_;
      }
      done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(size_t)>* job_ = nullptr;
  uint64_t generation_ = 0;
  size_t finished_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

std::vector<std::vector<PipeTask>> Pipeline::orders(int m) const {
  const int p = static_cast<int>(options_.devices.size());
  switch (options_.schedule) {
    case PipelineSchedule::kGPipe:
      return gpipe_order(p, m);
    case PipelineSchedule::k1F1B:
      return one_f_one_b_order(p, m);
    case PipelineSchedule::kInterleaved1F1B:
      return interleaved_order(p, options_.stages_per_device, m);
    case PipelineSchedule::kZeroBubbleH1:
      return zero_bubble_h1_order(p, m);
  }
  throw Error("unknown pipeline schedule");
}

// Note [Pipeline runner]: each device's thread runs its order of tasks (Note [Stage threads]).
// A stage's input is the previous stage's output, detached and moved to its device, so that
// each stage's backward is its own autograd graph; the gradient of that input is what the
// previous stage's backward starts from.
//
// Zero-bubble schedules split each stage's backward: Note [Split backward] in split_backward.cpp.
at::Tensor Pipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                const LossFn& loss_fn) {
  const int chunks = chunks_for(input.size(0));
  const auto xs = split_microbatches(input, chunks);
  const auto ys = split_microbatches(target, chunks);
  const int p = static_cast<int>(options_.devices.size());
  const auto stages = stages_.size();
  const int m = static_cast<int>(xs.size());
  const double total = static_cast<double>(input.size(0));
  const auto order = orders(m);
  const bool split = options_.schedule == PipelineSchedule::kZeroBubbleH1;
  auto slots = [&] {
    return std::vector<std::vector<at::Tensor>>(stages,
                                                std::vector<at::Tensor>(static_cast<size_t>(m)));
  };
  // [stage][micro-batch]: the stage's (detached) input, its output, and its input's gradient.
  auto inputs = slots(), outputs = slots(), input_grads = slots();
  std::vector<at::Tensor> losses(static_cast<size_t>(m));
  // Under a split backward, each stage's layers and each micro-batch's graphs.
  std::vector<SplitStage> splits;
  if (split) {
    for (auto& st : stages_) splits.emplace_back(st);
  }
  std::vector<std::vector<SplitStage::Graphs>> graphs(
      stages, std::vector<SplitStage::Graphs>(static_cast<size_t>(m)));

  const auto checkpointed = [&](size_t i) {
    return options_.checkpoint == PipelineCheckpoint::kAlways ||
           (options_.checkpoint == PipelineCheckpoint::kExceptLast &&
            i + 1 < static_cast<size_t>(m));
  };
  // Forward of stage k on micro-batch i from its stored input; the last stage adds the loss.
  auto forward = [&](size_t k, size_t i) {
    if (split && torch::GradMode::is_enabled()) {
      outputs[k][i] = splits[k].forward(inputs[k][i], graphs[k][i]);
    } else {
      outputs[k][i] = stages_[k]->forward(inputs[k][i]);
    }
    if (k + 1 == stages) {
      const double share = static_cast<double>(xs[i].size(0)) / total;
      losses[i] =
          loss_fn(outputs[k][i], ys[i].to(options_.devices[k % static_cast<size_t>(p)])) * share;
      if (split && !graphs[k][i].empty()) graphs[k][i].back().out = losses[i];
    }
  };
  // The gradient that stage k's backward starts from, on its device.
  auto output_grad = [&](size_t k, size_t i, const at::Device& dev) {
    if (k + 1 == stages) return at::ones_like(losses[i]);
    at::Tensor g = input_grads[k + 1][i].to(dev);
    input_grads[k + 1][i] = at::Tensor();  // released: the next stage no longer needs it
    inputs[k + 1][i] = at::Tensor();
    return g;
  };

  auto run = [&](size_t d, const PipeTask& t) {
    const auto k = static_cast<size_t>(t.chunk * p) + d;
    const auto i = static_cast<size_t>(t.microbatch);
    const auto& dev = options_.devices[d];
    switch (t.pass) {
      case Pass::kForward: {
        at::Tensor in = k == 0 ? xs[i].to(dev) : outputs[k - 1][i].detach().to(dev);
        if (k > 0) in.requires_grad_(true);
        inputs[k][i] = in;
        if (checkpointed(i)) {
          at::NoGradGuard no_graph;  // keep the input only; backward recomputes
          forward(k, i);
        } else {
          forward(k, i);
        }
        break;
      }
      case Pass::kBackward: {
        if (checkpointed(i)) forward(k, i);  // again, now recording the graph
        at::Tensor start = k + 1 == stages ? losses[i] : outputs[k][i];
        start.backward(output_grad(k, i, dev));
        if (k > 0) input_grads[k][i] = inputs[k][i].grad();
        outputs[k][i] = at::Tensor();
        break;
      }
      case Pass::kInputGrad: {
        if (checkpointed(i)) forward(k, i);
        at::Tensor g = splits[k].input_gradient(graphs[k][i], output_grad(k, i, dev));
        if (k > 0) input_grads[k][i] = g;
        outputs[k][i] = at::Tensor();
        break;
      }
      case Pass::kWeightGrad:
        splits[k].weight_gradient(graphs[k][i]);
        break;
    }
  };

  std::mutex mu;
  std::condition_variable cv;
  // done[kind][stage][micro-batch]: kind 0 forward, 1 input gradient (B or I).
  std::vector<std::vector<std::vector<char>>> done(
      2, std::vector<std::vector<char>>(stages, std::vector<char>(static_cast<size_t>(m), 0)));
  bool failed = false;
  auto ready = [&](size_t k, const PipeTask& t) {
    const auto i = static_cast<size_t>(t.microbatch);
    if (t.forward()) return k == 0 || done[0][k - 1][i] != 0;
    if (!t.input_gradient()) return true;  // W follows its own stage's I, run before it
    return k + 1 == stages ? done[0][k][i] != 0 : done[1][k + 1][i] != 0;
  };
  auto wait_until_ready = [&](size_t k, const PipeTask& t) {
    using Clock = std::chrono::steady_clock;
    const auto spin_until = Clock::now() + std::chrono::microseconds(50);
    std::unique_lock lock(mu);
    while (!failed && !ready(k, t) && Clock::now() < spin_until) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
    cv.wait(lock, [&] { return failed || ready(k, t); });
    return !failed;
  };
  const std::function<void(size_t)> job = [&](size_t d) {
    try {
      for (const PipeTask& t : order[d]) {
        const auto k = static_cast<size_t>(t.chunk * p) + d;
        if (!wait_until_ready(k, t)) return;
        run(d, t);
#ifdef SCALETRAIN_WITH_CUDA
        // The next stage reads what this task wrote, from another stream: finish it first.
        if (options_.devices[d].is_cuda()) {
          c10::cuda::getCurrentCUDAStream(options_.devices[d].index()).synchronize();
        }
#endif
        if (t.pass == Pass::kWeightGrad) continue;
        {
          std::lock_guard lock(mu);
          done[t.forward() ? 0 : 1][k][static_cast<size_t>(t.microbatch)] = 1;
        }
        cv.notify_all();
      }
    } catch (...) {
      {
        std::lock_guard lock(mu);
        failed = true;
      }
      cv.notify_all();
      throw;
    }
  };
  if (!threads_) threads_ = std::make_unique<StageThreads>(options_.devices);
  const auto errors = threads_->run(job);
  for (size_t d = 0; d < errors.size(); ++d) {
    if (!errors[d]) continue;
    try {
      std::rethrow_exception(errors[d]);
    } catch (const std::exception& e) {
      throw Error("pipeline stage " + std::to_string(d) + " (" + options_.devices[d].str() +
                  ") failed: " + e.what());
    }
  }
  at::Tensor sum = losses[0].detach().cpu();
  for (size_t i = 1; i < losses.size(); ++i) sum = sum + losses[i].detach().cpu();
  return sum;
}

}  // namespace scaletrain
