#include "scaletrain/pipeline.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "parallel/device_threads.h"
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
  if (options_.schedule == PipelineSchedule::kInterleaved1F1B) {
    const auto p = static_cast<int>(options_.devices.size());
    if (options_.split_size > 0 || options_.chunks % p != 0) {
      throw UsageError("interleaved 1F1B runs micro-batches in rounds of one per device: chunks " +
                       std::to_string(options_.chunks) +
                       (options_.split_size > 0 ? " (by split_size)" : "") + " on " +
                       std::to_string(p) + " devices; use a multiple of " + std::to_string(p) +
                       " (a batch too short for them runs fill-drain)");
    }
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

// Note [Stage threads]: one thread per device (DeviceThreads, src/parallel/device_threads.h),
// started at the first step and kept for the pipeline's life, runs its column of the schedule in
// order, waiting only for its data — a forward for the previous stage's forward, a backward for the
// next stage's input gradient — not for a whole tick. A slow task (a backward costs about two
// forwards) then delays only what depends on it. A thread that finds its data missing spins for a
// few microseconds before it sleeps: on a machine with a core per stage, a micro-batch handed over
// by the neighbour is usually there by then, and a sleeping thread takes tens of microseconds to
// wake.
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
namespace {

// Which tasks of a step are done, shared by the device threads: a thread waits here until its
// next task's data is there, or until another thread failed (Note [Stage threads]).
class TaskBoard {
 public:
  TaskBoard(size_t stages, size_t microbatches)
      : done_(2, std::vector<std::vector<char>>(stages, std::vector<char>(microbatches, 0))),
        stages_(stages) {}

  /// False when another thread failed (the step is over).
  bool wait_until_ready(size_t k, const PipeTask& t) {
    using Clock = std::chrono::steady_clock;
    const auto spin_until = Clock::now() + std::chrono::microseconds(50);
    std::unique_lock lock(mu_);
    while (!failed_ && !ready(k, t) && Clock::now() < spin_until) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
    cv_.wait(lock, [&] { return failed_ || ready(k, t); });
    return !failed_;
  }
  void mark_done(size_t k, const PipeTask& t) {
    if (t.pass == Pass::kWeightGrad) return;  // nothing waits for a W
    {
      std::lock_guard lock(mu_);
      done_[t.forward() ? 0 : 1][k][static_cast<size_t>(t.microbatch)] = 1;
    }
    cv_.notify_all();
  }
  void fail() {
    {
      std::lock_guard lock(mu_);
      failed_ = true;
    }
    cv_.notify_all();
  }

 private:
  // done_[0]: forwards; done_[1]: input gradients (B or I); [stage][micro-batch].
  bool ready(size_t k, const PipeTask& t) const {
    const auto i = static_cast<size_t>(t.microbatch);
    if (t.forward()) return k == 0 || done_[0][k - 1][i] != 0;
    if (!t.input_gradient()) return true;  // W follows its own stage's I, run before it
    return k + 1 == stages_ ? done_[0][k][i] != 0 : done_[1][k + 1][i] != 0;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<std::vector<char>>> done_;
  size_t stages_;
  bool failed_ = false;
};

// One training step's tensors, and the four kinds of task on them (Note [Pipeline runner]).
class StepRun {
 public:
  StepRun(const std::vector<torch::nn::Sequential>& stages, const PipelineOptions& options,
          const at::Tensor& input, const at::Tensor& target, int chunks, const LossFn& loss_fn)
      : stages_(stages),
        options_(options),
        loss_fn_(loss_fn),
        xs_(split_microbatches(input, chunks)),
        ys_(split_microbatches(target, chunks)),
        m_(xs_.size()),
        total_(static_cast<double>(input.size(0))),
        inputs_(slots()),
        outputs_(slots()),
        input_grads_(slots()),
        losses_(m_),
        split_(options.schedule == PipelineSchedule::kZeroBubbleH1),
        graphs_(stages.size(), std::vector<SplitStage::Graphs>(m_)) {
    if (split_) {
      for (const auto& st : stages_) splits_.emplace_back(st);
    }
  }

  int microbatches() const { return static_cast<int>(m_); }

  /// Runs task `t` of device `d`.
  void run(size_t d, const PipeTask& t) {
    const auto k = stage_of(d, t);
    const auto i = static_cast<size_t>(t.microbatch);
    const auto& dev = options_.devices[d];
    switch (t.pass) {
      case Pass::kForward: {
        at::Tensor in = k == 0 ? xs_[i].to(dev) : outputs_[k - 1][i].detach().to(dev);
        if (k > 0) in.requires_grad_(true);
        inputs_[k][i] = in;
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
        at::Tensor start = k + 1 == stages_.size() ? losses_[i] : outputs_[k][i];
        start.backward(output_grad(k, i, dev));
        if (k > 0) input_grads_[k][i] = inputs_[k][i].grad();
        outputs_[k][i] = at::Tensor();
        break;
      }
      case Pass::kInputGrad: {
        if (checkpointed(i)) forward(k, i);
        at::Tensor g = splits_[k].input_gradient(graphs_[k][i], output_grad(k, i, dev));
        if (k > 0) input_grads_[k][i] = g;
        outputs_[k][i] = at::Tensor();
        break;
      }
      case Pass::kWeightGrad:
        splits_[k].weight_gradient(graphs_[k][i]);
        break;
    }
  }

  /// The stage a device's task belongs to: its chunk's, on that device.
  size_t stage_of(size_t d, const PipeTask& t) const {
    return static_cast<size_t>(t.chunk) * options_.devices.size() + d;
  }

  /// The whole batch's loss, on the CPU.
  at::Tensor loss() const {
    at::Tensor sum = losses_[0].detach().cpu();
    for (size_t i = 1; i < losses_.size(); ++i) sum = sum + losses_[i].detach().cpu();
    return sum;
  }

 private:
  std::vector<std::vector<at::Tensor>> slots() const {
    return std::vector<std::vector<at::Tensor>>(stages_.size(), std::vector<at::Tensor>(m_));
  }
  bool checkpointed(size_t i) const {
    return options_.checkpoint == PipelineCheckpoint::kAlways ||
           (options_.checkpoint == PipelineCheckpoint::kExceptLast && i + 1 < m_);
  }
  // Forward of stage k on micro-batch i from its stored input; the last stage adds the loss.
  void forward(size_t k, size_t i) {
    if (split_ && torch::GradMode::is_enabled()) {
      outputs_[k][i] = splits_[k].forward(inputs_[k][i], graphs_[k][i]);
    } else {
      outputs_[k][i] = stages_[k]->forward(inputs_[k][i]);
    }
    if (k + 1 == stages_.size()) {
      const double share = static_cast<double>(xs_[i].size(0)) / total_;
      const auto& dev = options_.devices[k % options_.devices.size()];
      losses_[i] = loss_fn_(outputs_[k][i], ys_[i].to(dev)) * share;
      if (split_ && !graphs_[k][i].empty()) graphs_[k][i].back().out = losses_[i];
    }
  }
  // The gradient that stage k's backward starts from, on its device.
  at::Tensor output_grad(size_t k, size_t i, const at::Device& dev) {
    if (k + 1 == stages_.size()) return at::ones_like(losses_[i]);
    at::Tensor g = input_grads_[k + 1][i].to(dev);
#ifdef SCALETRAIN_WITH_CUDA
    // Made on stage k+1's stream, read by kernels this thread queues on its own: the caching
    // allocator must not hand the block back to k+1's stream before they ran.
    if (g.is_cuda()) g.record_stream(c10::cuda::getCurrentCUDAStream(dev.index()));
#endif
    input_grads_[k + 1][i] = at::Tensor();  // released: the next stage no longer needs it
    inputs_[k + 1][i] = at::Tensor();
    return g;
  }

  std::vector<torch::nn::Sequential> stages_;  // holders: the pipeline's own modules
  const PipelineOptions& options_;
  const LossFn& loss_fn_;
  const std::vector<at::Tensor> xs_, ys_;
  const size_t m_;
  const double total_;
  // [stage][micro-batch]: the stage's (detached) input, its output, and its input's gradient.
  std::vector<std::vector<at::Tensor>> inputs_, outputs_, input_grads_;
  std::vector<at::Tensor> losses_;
  // Under a split backward, each stage's layers and each micro-batch's graphs.
  const bool split_;
  std::vector<SplitStage> splits_;
  std::vector<std::vector<SplitStage::Graphs>> graphs_;
};

}  // namespace

at::Tensor Pipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                const LossFn& loss_fn) {
  StepRun step(stages_, options_, input, target, chunks_for(input.size(0)), loss_fn);
  const auto order = orders(step.microbatches());
  TaskBoard board(stages_.size(), static_cast<size_t>(step.microbatches()));
  const std::function<void(size_t)> job = [&](size_t d) {
    try {
      for (const PipeTask& t : order[d]) {
        const auto k = step.stage_of(d, t);
        if (!board.wait_until_ready(k, t)) return;
        step.run(d, t);
#ifdef SCALETRAIN_WITH_CUDA
        // The next stage reads what this task wrote, from another stream: finish it first.
        if (options_.devices[d].is_cuda()) {
          c10::cuda::getCurrentCUDAStream(options_.devices[d].index()).synchronize();
        }
#endif
        board.mark_done(k, t);
      }
    } catch (...) {
      board.fail();
      throw;
    }
  };
  if (!threads_) threads_ = std::make_unique<DeviceThreads>(options_.devices, true);
  threads_->run_or_throw(job, [&](size_t d) {
    return stages_.size() == options_.devices.size() ? "pipeline stage " + std::to_string(d)
                                                     : "pipeline device " + std::to_string(d);
  });
  return step.loss();
}

}  // namespace scaletrain
