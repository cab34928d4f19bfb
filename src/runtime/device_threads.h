#pragma once
// One persistent thread per device, with errors carried back to the caller (internal): the
// in-process pipeline's stage threads and DataParallel's replica threads.

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace scaletrain {

class DeviceThreads {
 public:
  /// Starts a thread per device, each for the object's life. `own_streams`: a CUDA device's
  /// thread works on a stream of its own from the pool (two pipeline stages on one GPU overlap;
  /// the job synchronises what others read), else on the device's current stream.
  DeviceThreads(std::vector<at::Device> devices, bool own_streams);
  /// Stops and joins the threads.
  ~DeviceThreads();
  DeviceThreads(const DeviceThreads&) = delete;
  DeviceThreads& operator=(const DeviceThreads&) = delete;

  /// Runs job(d) on device d's thread for every d < n (every device by default) and waits for
  /// all; returns each one's exception (null where none). One run at a time: a second caller
  /// waits for the first.
  std::vector<std::exception_ptr> run(const std::function<void(size_t)>& job, size_t n = SIZE_MAX);
  /// run(), then the first failure as Error("<name(d)> (<device>) failed: <its message>").
  void run_or_throw(const std::function<void(size_t)>& job,
                    const std::function<std::string(size_t)>& name, size_t n = SIZE_MAX);

  size_t size() const { return devices_.size(); }

 private:
  void loop(size_t d);
  void stop();

  std::vector<at::Device> devices_;
  bool own_streams_;
  std::mutex run_mu_;  // one run at a time
  std::mutex mu_;
  std::condition_variable start_, done_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t active_ = 0;  // threads d < active_ run this generation's job
  uint64_t generation_ = 0;
  size_t finished_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace scaletrain
