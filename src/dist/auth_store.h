#pragma once
// A c10d::Store that talks to a StoreServer after proving the job's secret (internal; Note
// [Store protocol] in store_server.cpp): what Gloo, NCCL and the library's own rendezvous use
// wherever a job has a secret.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "dist/store_server.h"

namespace scaletrain {

struct AuthStoreOptions {
  std::string host;
  int port = 0;
  std::string secret;
  std::string service = "store";
  /// Names the server in errors: "the store of run 'x'", "the lighthouse".
  std::string what = "the store";
  /// Connecting (retried until then) and each request; wait() takes its own.
  std::chrono::milliseconds timeout{300000};
};

/// Thread-safe: requests from several threads take turns on the one connection. Errors are
/// c10::DistStoreError (a wait past its timeout: "timed out") or c10::DistNetworkError (the
/// server is gone), one line naming `what`, its address and the fix; a server holding another
/// secret is a UsageError.
class AuthStore : public c10d::Store {
 public:
  /// Connects, retrying until options.timeout. `server`: kept alive with this client (rank 0
  /// serves the world's store in its own process).
  explicit AuthStore(AuthStoreOptions options, std::shared_ptr<StoreServer> server = nullptr);
  ~AuthStore() override;

  c10::intrusive_ptr<c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  void append(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<std::vector<uint8_t>>& values) override;
  bool hasExtendedApi() const override { return true; }

  std::string address() const { return o_.host + ":" + std::to_string(o_.port); }

 private:
  std::vector<std::string> request(uint8_t op, const std::vector<std::string>& parts,
                                   std::chrono::milliseconds timeout, const std::string& doing);
  void connect(std::chrono::milliseconds timeout);
  void drop();

  AuthStoreOptions o_;
  std::shared_ptr<StoreServer> server_;
  std::mutex mu_;
  int fd_ = -1;
  std::string in_;
};

}  // namespace scaletrain
