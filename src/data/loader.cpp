#include "scaletrain/loader.h"

#include <ATen/Parallel.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"

namespace scaletrain {

BatchFn batches_of(std::shared_ptr<const Dataset> d) {
  return [d](const std::vector<int64_t>& indices, uint64_t) {
    auto [x, y] = gather_batch(*d, indices);
    return Batch{x, y, 0};
  };
}

BatchFn batches_of(std::shared_ptr<const ImageFolder> f) {
  return [f](const std::vector<int64_t>& indices, uint64_t seed) {
    auto [x, y] = f->batch(indices, seed);
    return Batch{x, y, 0};
  };
}

// Workers take batch numbers w, w + W, w + 2W, ... and park each finished batch in `ready`;
// next() hands them out in order. A worker waits while its batch is `prefetch * W` or more
// ahead of the consumer, which bounds the memory held.
struct Loader::State {
  BatchFn build;
  std::vector<int64_t> indices;
  LoaderOptions o;
  int64_t batches = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::map<int64_t, Batch> ready;
  std::exception_ptr error;
  int64_t consumed = 0;  // batches handed out
  bool stop = false;
  std::vector<std::thread> threads;

  Batch make(int64_t b) {
    const auto start = static_cast<size_t>(b * o.batch_size);
    const auto end = std::min(indices.size(), start + static_cast<size_t>(o.batch_size));
    std::vector<int64_t> part(indices.begin() + static_cast<long>(start),
                              indices.begin() + static_cast<long>(end));
    // One seed per (loader seed, batch), mixed so that neighbouring batches differ widely.
    const int64_t number = o.first_batch + b;
    uint64_t z = o.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(number) + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    Batch out = build(part, z ^ (z >> 31));
    out.index = number;
    if (o.pin_memory && at::globalContext().hasCUDA()) {
      out.inputs = out.inputs.pin_memory();
      out.targets = out.targets.pin_memory();
    }
    return out;
  }

  void stop_threads() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
    threads.clear();
  }

  void work(int64_t first, int64_t step) {
    const int64_t window = static_cast<int64_t>(o.prefetch) * step;
    for (int64_t b = first; b < batches; b += step) {
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || b < consumed + window; });
        if (stop) return;
      }
      try {
        Batch batch = make(b);
        std::lock_guard lock(mu);
        ready.emplace(b, std::move(batch));
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
        stop = true;
      }
      cv.notify_all();
    }
  }
};

Loader::Loader(BatchFn build, std::vector<int64_t> indices, LoaderOptions o)
    : s_(std::make_unique<State>()) {
  if (o.batch_size < 1) {
    throw UsageError("loader batch size " + std::to_string(o.batch_size) + " must be at least 1");
  }
  if (o.workers < 0 || o.workers > kMaxLoaderWorkers || o.prefetch < 1) {
    throw UsageError("loader workers " + std::to_string(o.workers) + " must be from 0 to " +
                     std::to_string(kMaxLoaderWorkers) + " threads (e.g. 1 to 8), and prefetch " +
                     std::to_string(o.prefetch) + " at least 1");
  }
  s_->build = std::move(build);
  s_->indices = std::move(indices);
  s_->o = o;
  const auto n = static_cast<int64_t>(s_->indices.size());
  s_->batches = o.drop_last ? n / o.batch_size : (n + o.batch_size - 1) / o.batch_size;
  // Regression (WorkersOfAHundredThousandAbortedBothRanks): a thread the system refused threw
  // out of here with the started ones still joinable, and their destructor aborted the process.
  try {
    for (int w = 0; w < o.workers; ++w) {
      s_->threads.emplace_back([st = s_.get(), w] {
        at::init_num_threads();  // the process's intra-op thread count, not OpenMP's default
        st->work(w, st->o.workers);
      });
    }
  } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc
    const auto started = s_->threads.size();
    s_->stop_threads();
    throw Error("the loader could start " + std::to_string(started) + " of its " +
                std::to_string(o.workers) + " worker threads (" + e.what() +
                "): give fewer loader workers, or raise the process limit (ulimit -u)");
  }
}

Loader::~Loader() { s_->stop_threads(); }

int64_t Loader::num_batches() const { return s_->batches; }

std::optional<Batch> Loader::next() {
  State& s = *s_;
  if (s.consumed >= s.batches) return std::nullopt;
  if (s.o.workers == 0) return s.make(s.consumed++);
  std::unique_lock lock(s.mu);
  s.cv.wait(lock, [&] { return s.error || s.ready.count(s.consumed) > 0; });
  if (s.ready.count(s.consumed) == 0) std::rethrow_exception(s.error);
  auto node = s.ready.extract(s.consumed);
  ++s.consumed;
  lock.unlock();
  s.cv.notify_all();
  return std::move(node.mapped());
}

}  // namespace scaletrain
