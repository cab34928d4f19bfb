#pragma once
// The tests' lighthouse and a bare client of it (fault_tolerance_test.cpp, lighthouse_test.cpp).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dist/lighthouse_client.h"
#include "scaletrain/fault_tolerance.h"
#include "support/secret.h"

namespace scaletrain::testing {

// The lighthouse of a test, in a thread of its own, on a free port.
struct TestLighthouse {
  std::vector<std::string> quorums;
  std::mutex mu;
  LighthouseThread lighthouse;
  int port;
  TestLighthouse() : lighthouse(options(this)), port(lighthouse.port()) {}
  static LighthouseOptions options(TestLighthouse* self) {
    LighthouseOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.join_timeout = std::chrono::seconds(1);  // the first quorum waits this long
    o.secret = kTestSecret;
    o.on_quorum = [self](const std::string& q) {
      std::lock_guard<std::mutex> lock(self->mu);
      self->quorums.push_back(q);
    };
    return o;
  }
};

// A bare client of the lighthouse that holds the job's secret and speaks its keys (Note [Replica
// groups]) like rank 0 of replica `replica` with nonce `nonce`: it registers, beats from a
// thread until destroyed, and asks when told. The tests' stand-in for a process that is not a
// real replica (a stale one, a buggy one, or one that only pretends).
struct BareReplica {
  c10::intrusive_ptr<AuthStore> store;
  std::string key;
  std::atomic<bool> stop{false};
  std::thread beater;
  std::future<std::string> answer;
  int asked = 0;

  BareReplica(int port, int replica, const std::string& nonce)
      : store(lighthouse_client("127.0.0.1", port, kTestSecret, std::chrono::seconds(30))),
        key(std::to_string(replica) + "/" + nonce) {
    store->set("ft/reg/" + key, bytes("bare " + nonce));
    beater = std::thread([this, port] {
      auto own = lighthouse_client("127.0.0.1", port, kTestSecret, std::chrono::seconds(30));
      while (!stop) {
        own->add("ft/beat/" + key, 1);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~BareReplica() {
    stop = true;
    beater.join();
    if (answer.valid()) answer.wait();
  }
  static std::vector<uint8_t> bytes(const std::string& t) { return {t.begin(), t.end()}; }
  // Asks for the quorum of `step` with `settings`, in the background: answer.get() is the
  // lighthouse's answer ("" when none came within 30 s).
  void ask_async(int64_t step, const std::string& settings) {
    std::string token = key + "-" + std::to_string(++asked);
    for (auto& c : token) c = c == '/' ? '-' : c;
    store->set("ft/req/" + key, bytes(token + " " + std::to_string(step) + " 1 " + settings));
    answer = std::async(std::launch::async, [this, token] {
      try {
        store->wait({"ft/ans/" + token}, std::chrono::seconds(30));
        auto a = store->get("ft/ans/" + token);
        return std::string(a.begin(), a.end());
      } catch (const std::exception&) {
        return std::string();
      }
    });
  }
};

// Options of replica `id` at the test lighthouse `port`.
inline ReplicaGroupOptions replica_options(int port, int id) {
  ReplicaGroupOptions ro;
  ro.secret = kTestSecret;
  ro.lighthouse = "127.0.0.1:" + std::to_string(port);
  ro.replica_id = id;
  ro.timeout = std::chrono::seconds(3);
  ro.quorum_timeout = std::chrono::seconds(30);
  return ro;
}

}  // namespace scaletrain::testing
