#pragma once
// The job's key-value store, served to processes that prove the job's secret (internal; Note
// [Store protocol] in store_server.cpp). The workers' world store (rank 0 serves it) and the
// lighthouse's are one. AuthStore (auth_store.h) is its client, a c10d::Store. Built without
// LibTorch.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "launch/auth.h"

namespace scaletrain {

struct StoreServerOptions {
  std::string host = "0.0.0.0";  // the interface it listens on (net::listen_on's rules)
  int port = 0;                  // 0: a free one
  std::string secret;            // every client proves it (Note [Job secret])
  std::string service = "store";
  net::GateLimits limits;
  /// Told of refused connections (one line every few seconds at most); unset: spdlog's warn.
  std::function<void(const std::string&)> log;
};

/// A store on a thread of its own. Thread-safe: the in-process calls may come from any thread
/// while the server thread answers its clients.
class StoreServer {
 public:
  /// Listens; throws Error naming the address and why (taken port, another machine's address).
  explicit StoreServer(StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

  // In-process access, for the lighthouse, which owns its server (no socket, no proof).
  void set(const std::string& key, const std::string& value);
  std::optional<std::string> get(const std::string& key) const;
  int64_t add(const std::string& key, int64_t delta);
  bool erase(const std::string& key);
  /// Every key that starts with `prefix`.
  std::vector<std::string> keys(const std::string& prefix) const;
  /// A count of the changes so far; wait_for_change() returns once it passes `seen`.
  uint64_t changes() const;
  /// Until some key changed after `seen` (true) or `timeout` passed (false).
  bool wait_for_change(uint64_t seen, std::chrono::milliseconds timeout) const;
  /// Connections that proved the secret and are open now.
  size_t clients() const { return clients_.load(); }

  struct Core;  // the server thread's state (store_server.cpp)

 private:
  void serve();

  int listener_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::unique_ptr<Core> core_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> clients_{0};
  std::thread thread_;
};

}  // namespace scaletrain
