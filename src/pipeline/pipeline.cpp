#include "scaletrain/pipeline.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "pipeline/stage_runner.h"
#include "runtime/device_threads.h"
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

int Pipeline::chunks_for(int64_t batch) const {
  if (options_.split_size <= 0) return options_.chunks;
  return static_cast<int>(
      std::max<int64_t>(1, (batch + options_.split_size - 1) / options_.split_size));
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
        "sharing the model's own submodules; check_chain() verifies it), or as_sequential() of a "
        "scaletrain::Model that has a block form");
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

// Note [Stage threads]: one thread per device (DeviceThreads, src/runtime/device_threads.h),
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

// Each device's thread runs its order of tasks (Note [Stage threads]) through a StageRunner
// (Note [Pipeline runner] in stage_runner.h) over the stages it holds; the stages hand their
// activations and gradients to each other in memory (HandOff).
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

// The stages' hand-offs of one step: [stage][micro-batch], an output for the next stage (detached)
// and an input gradient for the previous one. A slot is written by one device's thread and read
// by another's after the TaskBoard said it was done, and emptied when read.
struct HandOffSlots {
  HandOffSlots(size_t stages, size_t microbatches)
      : outputs(stages, std::vector<at::Tensor>(microbatches)),
        input_grads(stages, std::vector<at::Tensor>(microbatches)) {}
  std::vector<std::vector<at::Tensor>> outputs, input_grads;
};

at::Tensor take(at::Tensor& slot) { return std::exchange(slot, at::Tensor()); }

// Device d's link: its chunk c is stage c·p + d.
class HandOff : public StageLink {
 public:
  HandOff(HandOffSlots& slots, size_t d, size_t p, at::Device device)
      : slots_(slots), d_(d), p_(p), device_(device) {}
  at::Tensor input(int i, int c) override {
    return read_here(take(slots_.outputs[stage(c) - 1][mb(i)]));
  }
  void output(int i, int c, const at::Tensor& out) override {
    slots_.outputs[stage(c)][mb(i)] = out.detach();
  }
  at::Tensor output_grad(int i, int c, const at::Tensor&) override {
    return read_here(take(slots_.input_grads[stage(c) + 1][mb(i)])).to(device_);
  }
  void input_grad(int i, int c, const at::Tensor& grad) override {
    slots_.input_grads[stage(c)][mb(i)] = grad;
  }

 private:
  size_t stage(int c) const { return static_cast<size_t>(c) * p_ + d_; }
  // A tensor another stage's thread made on its stream, now read (copied, or computed on) by
  // kernels this thread queues on its own, and possibly freed here before they ran: the caching
  // allocator must not hand its block back to the maker's stream until they did.
  static at::Tensor read_here(at::Tensor t) {
#ifdef SCALETRAIN_WITH_CUDA
    if (t.defined() && t.is_cuda()) {
      t.record_stream(c10::cuda::getCurrentCUDAStream(t.device().index()));
    }
#endif
    return t;
  }
  static size_t mb(int i) { return static_cast<size_t>(i); }
  HandOffSlots& slots_;
  size_t d_, p_;
  at::Device device_;
};

}  // namespace

at::Tensor Pipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                const LossFn& loss_fn) {
  const size_t p = options_.devices.size(), stages = stages_.size();
  if (target.dim() == 0 || target.size(0) != input.size(0)) {
    throw UsageError("Pipeline::train_step: the target has " +
                     (target.dim() == 0 ? std::string("no batch dimension")
                                        : std::to_string(target.size(0)) + " rows") +
                     " and the input " + std::to_string(input.size(0)) +
                     ": both are cut into the same micro-batches, so give one target row per "
                     "input row");
  }
  StageStep step;
  step.inputs = split_microbatches(input, chunks_for(input.size(0)));
  step.targets = split_microbatches(target, static_cast<int>(step.inputs.size()));
  step.total = static_cast<double>(target.size(0));
  step.microbatches = static_cast<int>(step.inputs.size());
  const auto order = orders(step.microbatches);
  TaskBoard board(stages, step.inputs.size());
  HandOffSlots slots(stages, step.inputs.size());
  std::vector<at::Tensor> losses(p);
  const std::function<void(size_t)> job = [&](size_t d) {
    try {
      std::vector<StageRunner::Chunk> chunks;
      for (size_t k = d; k < stages; k += p)
        chunks.push_back({stages_[k], k == 0, k + 1 == stages});
      HandOff link(slots, d, p, options_.devices[d]);
      StageRunner runner(std::move(chunks), options_.devices[d], options_.schedule,
                         options_.checkpoint, link, loss_fn, step);
      for (const PipeTask& t : order[d]) {
        const auto k = static_cast<size_t>(t.chunk) * p + d;
        if (!board.wait_until_ready(k, t)) return;
        runner.run(t);
#ifdef SCALETRAIN_WITH_CUDA
        // The next stage reads what this task wrote, from another stream: finish it first.
        if (options_.devices[d].is_cuda()) {
          c10::cuda::getCurrentCUDAStream(options_.devices[d].index()).synchronize();
        }
#endif
        board.mark_done(k, t);
      }
      losses[d] = runner.loss();
    } catch (...) {
      board.fail();
      throw;
    }
  };
  if (!threads_) threads_ = std::make_unique<DeviceThreads>(options_.devices, true);
  threads_->run_or_throw(job, [&](size_t d) {
    return stages == p ? "pipeline stage " + std::to_string(d)
                       : "pipeline device " + std::to_string(d);
  });
  return losses[(stages - 1) % p];
}

}  // namespace scaletrain
