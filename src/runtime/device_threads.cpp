#include "runtime/device_threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>

#include "scaletrain/error.h"

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace scaletrain {

DeviceThreads::DeviceThreads(std::vector<at::Device> devices, bool own_streams)
    : devices_(std::move(devices)), own_streams_(own_streams) {
  errors_.resize(devices_.size());
  try {
    for (size_t d = 0; d < devices_.size(); ++d) threads_.emplace_back([this, d] { loop(d); });
  } catch (...) {  // a thread that could not start: stop those that did, then report it
    stop();
    throw;
  }
}

DeviceThreads::~DeviceThreads() { stop(); }

void DeviceThreads::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

std::vector<std::exception_ptr> DeviceThreads::run(const std::function<void(size_t)>& job,
                                                   size_t n) {
  std::lock_guard one_run(run_mu_);
  std::unique_lock lock(mu_);
  job_ = &job;
  active_ = std::min(n, threads_.size());
  finished_ = 0;
  for (auto& e : errors_) e = nullptr;
  ++generation_;
  start_.notify_all();
  done_.wait(lock, [&] { return finished_ == threads_.size(); });
  job_ = nullptr;
  return errors_;
}

void DeviceThreads::run_or_throw(const std::function<void(size_t)>& job,
                                 const std::function<std::string(size_t)>& name, size_t n) {
  const auto errors = run(job, n);
  for (size_t d = 0; d < errors.size(); ++d) {
    if (!errors[d]) continue;
    try {
      std::rethrow_exception(errors[d]);
    } catch (const std::exception& e) {
      throw Error(name(d) + " (" + devices_[d].str() + ") failed: " + e.what());
    }
  }
}

void DeviceThreads::loop(size_t d) {
#ifdef SCALETRAIN_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> stream;
  if (own_streams_ && devices_[d].is_cuda()) {
    stream.emplace(c10::cuda::getStreamFromPool(false, devices_[d].index()));
  }
#endif
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(size_t)>* job = nullptr;
    {
      std::unique_lock lock(mu_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = d < active_ ? job_ : nullptr;
    }
    std::exception_ptr error;
    if (job != nullptr) {
      try {
        // The process's intra-op setting as it is now (a new thread starts with OpenMP's
        // default team, every core: threads would oversubscribe them). An error here is the
        // job's, raised on the caller's thread.
        at::init_num_threads();
        (*job)(d);
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard lock(mu_);
      errors_[d] = error;
      ++finished_;
    }
    done_.notify_all();
  }
}

}  // namespace scaletrain
