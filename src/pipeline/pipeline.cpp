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
  if (options_.devices.size() != options_.balance.size()) {
    throw UsageError("pipeline has " + std::to_string(options_.balance.size()) + " stages but " +
                     std::to_string(options_.devices.size()) + " devices; give one per stage");
  }
  std::vector<torch::nn::AnyModule> layers(model->begin(), model->end());
  size_t layer = 0;
  for (size_t s = 0; s < options_.balance.size(); ++s) {
    torch::nn::Sequential stage;
    for (int i = 0; i < options_.balance[s]; ++i) stage->push_back(layers[layer++]);
    stage->to(options_.devices[s]);
    stages_.push_back(stage);
  }
}

at::Tensor Pipeline::forward(const at::Tensor& input) {
  std::vector<at::Tensor> outs;
  for (auto& mb : split_microbatches(input, chunks_for(input.size(0)))) {
    at::Tensor h = mb;
    for (size_t s = 0; s < stages_.size(); ++s) h = stages_[s]->forward(h.to(options_.devices[s]));
    outs.push_back(h);
  }
  return at::cat(outs);
}

// Note [Pipeline runner]: the schedule's table gives each stage its order of tasks; each stage
// runs them on its own thread, as soon as their data is there (Note [Stage threads]). A stage's
// input is the previous stage's output, detached and moved to its device, so that each stage's
// backward is its own autograd graph; the gradient of that input is what the previous stage's
// backward starts from.
at::Tensor Pipeline::train_step(const at::Tensor& input, const at::Tensor& target,
                                const LossFn& loss_fn) {
  const int chunks = chunks_for(input.size(0));
  const auto xs = split_microbatches(input, chunks);
  const auto ys = split_microbatches(target, chunks);
  const int p = static_cast<int>(stages_.size());
  const int m = static_cast<int>(xs.size());
  const double total = static_cast<double>(input.size(0));
  const ScheduleTable table = options_.schedule == PipelineSchedule::kGPipe
                                  ? gpipe_schedule(p, m)
                                  : one_f_one_b_schedule(p, m);
  // inputs[s][i]: stage s's (detached) input of micro-batch i; outputs[s][i]: its output.
  std::vector<std::vector<at::Tensor>> inputs(static_cast<size_t>(p),
                                              std::vector<at::Tensor>(static_cast<size_t>(m)));
  auto outputs = inputs;
  std::vector<at::Tensor> losses(static_cast<size_t>(m));

  const auto checkpointed = [&](size_t i) {
    return options_.checkpoint == PipelineCheckpoint::kAlways ||
           (options_.checkpoint == PipelineCheckpoint::kExceptLast &&
            i + 1 < static_cast<size_t>(m));
  };
  // Forward of stage s on micro-batch i from its stored input; the last stage adds the loss.
  auto forward = [&](size_t si, size_t i) {
    outputs[si][i] = stages_[si]->forward(inputs[si][i]);
    if (si + 1 == static_cast<size_t>(p)) {
      const double share = static_cast<double>(xs[i].size(0)) / total;
      losses[i] = loss_fn(outputs[si][i], ys[i].to(options_.devices[si])) * share;
    }
  };

  auto run = [&](int s, const PipeTask& t) {
    const auto si = static_cast<size_t>(s);
    const auto i = static_cast<size_t>(t.microbatch);
    const auto& dev = options_.devices[si];
    if (t.forward) {
      at::Tensor in = s == 0 ? xs[i].to(dev) : outputs[si - 1][i].detach().to(dev);
      if (s > 0) in.requires_grad_(true);
      inputs[si][i] = in;
      if (checkpointed(i)) {
        at::NoGradGuard no_graph;  // keep the input only; backward recomputes
        forward(si, i);
      } else {
        forward(si, i);
      }
    } else {
      if (checkpointed(i)) forward(si, i);  // again, now recording the graph
      if (s == p - 1) {
        losses[i].backward();
      } else {
        auto grad = inputs[si + 1][i].grad().to(dev);
        outputs[si][i].backward(grad);
        inputs[si + 1][i] = at::Tensor();  // release what the next stage no longer needs
      }
      outputs[si][i] = at::Tensor();
    }
  };

  // Note [Stage threads]: one thread per stage runs its column of the table in order, waiting
  // only for its data — stage s's forward of micro-batch i for the previous stage's, its
  // backward for the next stage's backward — not for a whole tick. A slow task (a backward
  // costs about two forwards) then delays only what depends on it, instead of every stage.
  std::vector<std::vector<PipeTask>> order(static_cast<size_t>(p));
  for (const auto& row : table) {
    for (size_t s = 0; s < row.size(); ++s) {
      if (row[s]) order[s].push_back(*row[s]);
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<char>> forward_done(static_cast<size_t>(p),
                                              std::vector<char>(static_cast<size_t>(m), 0));
  auto backward_done = forward_done;
  bool failed = false;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(p));
  auto ready = [&](size_t s, const PipeTask& t) {
    const auto i = static_cast<size_t>(t.microbatch);
    if (t.forward) return s == 0 || forward_done[s - 1][i] != 0;
    return s + 1 == static_cast<size_t>(p) ? forward_done[s][i] != 0 : backward_done[s + 1][i] != 0;
  };
  std::vector<std::thread> workers;
  for (size_t s = 0; s < static_cast<size_t>(p); ++s) {
    workers.emplace_back([&, s] {
      // A new thread starts with OpenMP's default team size (every core); take the process's
      // intra-op setting instead, or stages oversubscribe the cores.
      at::init_num_threads();
      try {
#ifdef SCALETRAIN_WITH_CUDA
        // Each CUDA stage works on a stream of its own, so two stages on one GPU overlap.
        std::optional<c10::cuda::CUDAStreamGuard> stream;
        if (options_.devices[s].is_cuda()) {
          stream.emplace(c10::cuda::getStreamFromPool(false, options_.devices[s].index()));
        }
#endif
        for (const PipeTask& t : order[s]) {
          {
            std::unique_lock lock(mu);
            cv.wait(lock, [&] { return failed || ready(s, t); });
            if (failed) return;
          }
          run(static_cast<int>(s), t);
#ifdef SCALETRAIN_WITH_CUDA
          // The next stage reads what this task wrote, from another stream: finish it first.
          if (stream) stream->current_stream().synchronize();
#endif
          {
            std::lock_guard lock(mu);
            (t.forward ? forward_done : backward_done)[s][static_cast<size_t>(t.microbatch)] = 1;
          }
          cv.notify_all();
        }
      } catch (...) {
        errors[s] = std::current_exception();
        {
          std::lock_guard lock(mu);
          failed = true;
        }
        cv.notify_all();
      }
    });
  }
  for (auto& w : workers) w.join();
  for (int s = 0; s < p; ++s) {
    if (!errors[static_cast<size_t>(s)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<size_t>(s)]);
    } catch (const std::exception& e) {
      throw Error("pipeline stage " + std::to_string(s) + " (" +
                  options_.devices[static_cast<size_t>(s)].str() + ") failed: " + e.what());
    }
  }
  at::Tensor sum = losses[0].detach().cpu();
  for (size_t i = 1; i < losses.size(); ++i) sum = sum + losses[i].detach().cpu();
  return sum;
}

}  // namespace scaletrain
