#pragma once
// Runs N ranks as threads of one test process, each with its own process group over a fresh
// loopback port (gloo's own tests work this way). Exceptions are collected per rank. The ranks
// share the process's cores, one intra-op thread each; the process gets its own count back after,
// so that a test that follows in the same process (a suite runs in one) computes as it would
// alone.

#include <ATen/Parallel.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/dist.h"
#include "support/secret.h"
#include "support/subprocess.h"

namespace scaletrain::testing {

/// Returns each rank's error message ("" when it returned normally).
///
/// Regression (TwoTestsMetOnOnePort): the port is drawn at random and only probed, so a test
/// running beside this one could draw it too. Their ranks shared one secret, so a rank of one
/// test could join the other's store, and both failed in Gloo's connection ("Connection closed
/// by peer"). Each call now has a secret of its own (another test's ranks cannot prove it), and
/// when the ranks failed before any of them reached `body` because the port was taken or their
/// store was another's, the ranks start again on another port (at most 3 times).
inline std::vector<std::string> run_ranks(
    int n, const std::function<void(Dist&)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& backend = "gloo", const std::function<int()>& pick_port = free_port) {
  struct Threads {
    int before = at::get_num_threads();
    Threads() { at::set_num_threads(1); }
    ~Threads() { at::set_num_threads(before); }
  } threads_per_rank;
  static std::atomic<int> calls{0};
  for (int attempt = 1;; ++attempt) {
    const int port = pick_port();
    const std::string secret =
        std::string(kTestSecret) + "-" + std::to_string(::getpid()) + "-" + std::to_string(++calls);
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::atomic<bool> began{false};
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          InitOptions o;
          World w;
          w.rank = r;
          w.world_size = n;
          w.local_rank = r;
          w.local_world_size = n;
          w.master_port = port;
          o.world = w;
          o.timeout = timeout;
          o.backend = backend;  // Gloo unless a test asks for NCCL, also on a machine with GPUs
          o.rendezvous_timeout = std::chrono::seconds(30);
          o.secret = secret;  // the world's store proves it (Note [Job secret])
          Dist d = init_process_group(o);
          began = true;
          body(d);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
          if (errors[static_cast<size_t>(r)].empty())
            errors[static_cast<size_t>(r)] = "(empty error)";
        }
      });
    }
    for (auto& t : threads) t.join();
    bool port_taken = false;
    for (const auto& e : errors) {
      port_taken |= e.find("could not serve the rendezvous store") != std::string::npos ||
                    e.find("cannot listen on") != std::string::npos ||
                    e.find("Address already in use") != std::string::npos ||
                    e.find("this job's secret") != std::string::npos;
    }
    if (began || !port_taken || attempt == 3) return errors;
  }
}

}  // namespace scaletrain::testing
