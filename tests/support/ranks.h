#pragma once
// Runs N ranks as threads of one test process, each with its own process group over a fresh
// loopback port (gloo's own tests work this way). Exceptions are collected per rank. The ranks
// share the process's cores, one intra-op thread each; the process gets its own count back after,
// so that a test that follows in the same process (a suite runs in one) computes as it would
// alone.

#include <ATen/Parallel.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/dist.h"
#include "support/secret.h"
#include "support/subprocess.h"

namespace scaletrain::testing {

/// Returns each rank's error message ("" when it returned normally).
inline std::vector<std::string> run_ranks(
    int n, const std::function<void(Dist&)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& backend = "gloo") {
  struct Threads {
    int before = at::get_num_threads();
    Threads() { at::set_num_threads(1); }
    ~Threads() { at::set_num_threads(before); }
  } threads_per_rank;
  const int port = free_port();
  std::vector<std::string> errors(static_cast<size_t>(n));
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
        o.secret = kTestSecret;  // the world's store proves it (Note [Job secret])
        Dist d = init_process_group(o);
        body(d);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty())
          errors[static_cast<size_t>(r)] = "(empty error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace scaletrain::testing
