#pragma once
// A counting allocator in front of LibTorch's CPU allocator (the memory suites', internal):
// measured memory, not estimated. It records the bytes held by live CPU tensors and their peak,
// over the process and per allocating thread (a tensor freed by another thread is taken off its
// allocator's count).

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace scaletrain::bench {

// Live bytes and their peak.
struct Count {
  std::atomic<int64_t> live{0}, peak{0};
  void add(int64_t n) {
    const int64_t now = live += n;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};

// Counts the bytes of live CPU tensors allocated through it, and their peak: in all, and per
// allocating thread (a tensor freed by another thread is taken off its allocator's count).
// The pointer it hands out is the data's own and its context too (raw_allocate(), which some
// kernels use for scratch, wants them equal); what it holds for each lives in a registry that
// outlasts every allocator, with counts that are never freed, so that a tensor freed after the
// measurement still finds its entry.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // nothing to count
    const c10::Device device = inner.device();
    Count* thread = &of_this_thread();
    all_->add(static_cast<int64_t>(n));
    thread->add(static_cast<int64_t>(n));
    {
      std::lock_guard<std::mutex> lock(registry().mu);
      registry().held[data] = Held{std::move(inner), n, all_, thread};
    }
    return {data, data, &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // Starts a measurement: peaks from now on, and each count's bytes now.
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    all_->peak = all_->live.load();
    before_.clear();
    for (auto& [id, c] : threads_) {
      c->peak = c->live.load();
      before_[id] = c->live.load();
    }
  }
  int64_t live() const { return all_->live; }
  int64_t peak() const { return all_->peak; }
  // The largest rise of one thread's bytes since reset_peak() (a thread that started since
  // began at 0).
  int64_t peak_of_fullest_thread() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t most = 0;
    for (const auto& [id, c] : threads_) {
      auto b = before_.find(id);
      most = std::max(most, c->peak.load() - (b == before_.end() ? 0 : b->second));
    }
    return most;
  }

 private:
  struct Held {
    c10::DataPtr inner;
    size_t bytes = 0;
    Count *all = nullptr, *thread = nullptr;
  };
  struct Registry {
    std::mutex mu;
    std::map<void*, Held> held;
  };
  static Registry& registry() {
    static auto* r = new Registry;  // never destroyed: frees may come at exit
    return *r;
  }
  static void release(void* p) {
    Held h;
    {
      std::lock_guard<std::mutex> lock(registry().mu);
      auto it = registry().held.find(p);
      if (it == registry().held.end()) return;
      h = std::move(it->second);
      registry().held.erase(it);
    }
    h.all->live -= static_cast<int64_t>(h.bytes);
    h.thread->live -= static_cast<int64_t>(h.bytes);
  }  // h.inner frees the memory
  Count& of_this_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    auto& c = threads_[std::this_thread::get_id()];
    if (c == nullptr) c = new Count;  // never freed, as all_: a late free still counts down
    return *c;
  }
  c10::Allocator* base_;
  Count* all_ = new Count;
  mutable std::mutex mu_;
  std::map<std::thread::id, Count*> threads_;  // never erased while counting
  std::map<std::thread::id, int64_t> before_;
};

// SetCPUAllocator only replaces an allocator set with a lower or equal priority.
inline uint8_t next_priority() {
  static uint8_t p = 100;
  return ++p;
}

// Puts a counting allocator in front of LibTorch's CPU allocator for a scope; the original is
// back before the counter is destroyed, also when the suite throws.
class CountingScope {
 public:
  CountingScope() : base_(c10::GetCPUAllocator()), counting_(base_) {
    c10::SetCPUAllocator(&counting_, next_priority());
  }
  ~CountingScope() { c10::SetCPUAllocator(base_, next_priority()); }
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;
  CountingAllocator& counter() { return counting_; }

 private:
  c10::Allocator* base_;
  CountingAllocator counting_;
};

}  // namespace scaletrain::bench
