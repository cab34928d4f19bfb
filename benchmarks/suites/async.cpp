// Suite `async` (seed 004). On a GPU, kernel launches return before the work is done: a timer
// read without synchronising measures the launches, not the work. Work queued on every device
// before synchronising runs concurrently. A device-to-host copy with non_blocking overlaps the
// queue instead of stalling it. On a CPU every operation is synchronous, so the paired bars
// should match — which is itself the check that the timing method is sound.

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>

#include "scaletrain/version.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

std::vector<at::Tensor> run(const at::Tensor& x, int count) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < count; ++i) out.push_back(x.mm(x));
  return out;
}

}  // namespace

SuiteResult run_async(const SuiteOptions& o) {
  const std::string title = "Asynchronous vs synchronised timing (seed 004)";
  SuiteResult r =
      new_result("async", title, "s", {Plot::Kind::kBars, title, "", "seconds", false, false}, o);

  std::vector<at::Device> devices;
  for (int i = 0; i < cuda_device_count(); ++i) devices.emplace_back(at::kCUDA, i);
  if (devices.empty()) devices.emplace_back(at::kCPU);
  const int64_t n = o.quick || devices.front().is_cpu() ? 512 : 4000;
  const int count = o.quick ? 10 : 50;
  r.notes.push_back("Each run: " + std::to_string(count) + " products of a " + std::to_string(n) +
                    "×" + std::to_string(n) + " fp32 matrix, as in the seed.");

  std::vector<at::Tensor> xs;
  for (auto& d : devices) xs.push_back(at::rand({n, n}, at::TensorOptions().device(d)));
  for (size_t i = 0; i < devices.size(); ++i) run(xs[i], 2), sync(devices[i]);  // warm-up

  const std::string series = devices.front().str();
  Sample unsynced{series, "timer without sync", 0, {}};
  Sample synced{series, "timer after sync", 1, {}};
  Sample one_by_one{series, "devices one by one", 2, {}};
  Sample at_once{series, "all devices at once", 3, {}};
  Sample copy_block{series, "copy to host", 4, {}};
  Sample copy_async{series, "copy non_blocking", 5, {}};
  for (int rep = 0; rep < o.repeats; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    auto y = run(xs[0], count);
    unsynced.values.push_back(seconds_since(t0));
    sync(devices[0]);
    t0 = std::chrono::steady_clock::now();
    y = run(xs[0], count);
    sync(devices[0]);
    synced.values.push_back(seconds_since(t0));

    t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < devices.size(); ++i) run(xs[i], count), sync(devices[i]);
    one_by_one.values.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < devices.size(); ++i) run(xs[i], count);
    for (auto& d : devices) sync(d);
    at_once.values.push_back(seconds_since(t0));

    // Seed 004 times the products plus their copies to the host, both ways.
    t0 = std::chrono::steady_clock::now();
    y = run(xs[0], count);
    for (auto& t : y) t.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false);
    sync(devices[0]);
    copy_block.values.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    y = run(xs[0], count);
    for (auto& t : y) t.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/true);
    sync(devices[0]);
    copy_async.values.push_back(seconds_since(t0));
  }
  r.samples = {unsynced, synced, one_by_one, at_once, copy_block, copy_async};
  if (devices.front().is_cpu()) {
    r.notes.push_back(
        "No GPU here: CPU operations are synchronous, so each pair should match; "
        "the differences the seed shows appear on a GPU.");
  }
  return r;
}

}  // namespace scaletrain::bench
