// `scaletrain check`: joins the process group and verifies collectives end to end — the
// quickest way to see that a cluster, a launcher and the network are wired right.

#include <ATen/ATen.h>

#include <chrono>
#include <iostream>
#include <limits>

#include <torch/nn/modules/linear.h>

#include "commands.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist.h"

namespace scaletrain::cli {

void add_check_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("check", kCheckDescription);
  struct Args {
    std::string backend = "auto";
    int64_t numel = 1 << 20;
    double timeout_s = 300;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--backend", args->backend, "gloo, nccl or auto")->capture_default_str();
  cmd->add_option("--numel", args->numel, "Elements in the all-reduced tensor")
      ->capture_default_str();
  cmd->add_option("--timeout", args->timeout_s, "Collective timeout in seconds")
      ->capture_default_str();
  cmd->callback([args, &action] {
    action = [args] {
      InitOptions io;
      io.backend = args->backend;
      io.timeout = std::chrono::milliseconds(static_cast<long>(args->timeout_s * 1000));
      auto t0 = std::chrono::steady_clock::now();
      Dist d = init_process_group(io);
      auto device = d.backend_name == "nccl" ? at::Device(at::kCUDA, d.world.local_rank)
                                             : at::Device(at::kCPU);
      const int w = d.size();
      // all-reduce: rank r contributes r+1 everywhere, so every element must be w(w+1)/2.
      auto t = at::full({args->numel}, d.rank() + 1.0,
                        at::TensorOptions().dtype(at::kFloat).device(device));
      d.all_reduce(t, ReduceOp::SUM, "all-reduce");
      const double want = w * (w + 1) / 2.0;
      bool ok = at::all(t.eq(want)).item<bool>();
      // broadcast from rank 0.
      auto b = at::full({4}, d.rank() == 0 ? 42.0 : -1.0, at::TensorOptions().device(device));
      d.broadcast(b, 0, "broadcast");
      ok = ok && at::all(b.eq(42.0)).item<bool>();
      d.barrier("barrier");
      // DDP's gradient sum, on the path it takes here (shared memory, hierarchical, backend):
      // rank r feeds r + 1 to a linear layer, so the averaged weight gradient is (w + 1) / 2.
      // DDP divides by w before summing: float rounding of w terms of size up to 1, each off by
      // at most half an ulp, and the sum's own w roundings — within 2w·eps of the result.
      torch::nn::Linear lin(8, 4);
      lin->to(device);
      DistributedDataParallel ddp(lin.ptr(), d);
      ddp(at::full({1, 8}, d.rank() + 1.0, at::TensorOptions().device(device))).sum().backward();
      const double eps = std::numeric_limits<float>::epsilon();
      const bool ddp_ok =
          at::allclose(lin->weight.grad().cpu(), at::full({4, 8}, (w + 1) / 2.0), 2 * w * eps, 0) &&
          at::allclose(lin->bias.grad().cpu(), at::ones({4}), 2 * w * eps, 0);
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::cout << describe(d.world) << "\n"
                << "rank " << d.rank() << ": " << d.backend_name << " all-reduce of " << args->numel
                << " floats " << (ok ? "ok" : "WRONG") << " (expected " << want << ", got "
                << t[0].item<float>() << "), broadcast and barrier " << (ok ? "ok" : "checked")
                << ", DDP gradients through " << ddp.reduce_path() << " "
                << (ddp_ok ? "ok" : "WRONG") << ", " << ms << " ms in all" << std::endl;
      return ok && ddp_ok ? 0 : 1;
    };
  });
}

}  // namespace scaletrain::cli
