// LibTorch's CUDA half on demand (Note [CUDA half on demand], src/runtime/torch_cuda.cpp): a
// process loads libtorch_cuda where a CUDA driver exists, and otherwise starts without it.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <climits>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "dist/nccl_module.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"
#include "support/subprocess.h"

namespace scaletrain {
namespace {

bool cuda_half_mapped() {
  std::ifstream maps("/proc/self/maps");
  const std::string all((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
  return all.find("libtorch_cuda.so") != std::string::npos;
}

bool add_has_a_cuda_kernel() {
  auto op = c10::Dispatcher::singleton().findSchema({"aten::add", "Tensor"});
  return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

std::string this_program() {
  char path[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, n) : "";
}

// What this process loaded, for the test below, which runs it under other settings.
TEST(TorchCudaHalf, ReportWhatThisProcessLoaded) {
  std::cout << "status: " << torch_cuda_status() << "\n"
            << "mapped: " << cuda_half_mapped() << "\n"
            << "cuda kernels: " << add_has_a_cuda_kernel()
            << "\n"
            // LibTorch settles its CUDA hooks once: asked before the CUDA half came, they stay
            // without CUDA for good.
            << "cuda hooks: " << at::detail::getCUDAHooks().hasCUDART() << "\n"
            << "devices: " << cuda_device_count() << "\n";
  if (torch_cuda_status() == "loaded" && cuda_device_count() == 0) {
    // The NCCL module opens, and its factory answers (a group, or why not without a GPU).
    std::string why;
    try {
      auto store = c10::make_intrusive<c10d::HashStore>();
      c10d::Backend* b = nccl_factory()(store.get(), 0, 1, 1000, &why);
      if (b != nullptr) {
        why = "built a " + c10::intrusive_ptr<c10d::Backend>::reclaim(b)->getBackendName();
      }
      std::cout << "nccl module: opened (" << why << ")\n";
    } catch (const Error& e) {
      std::cout << "nccl module: " << e.what() << "\n";
    }
  }
}

TEST(TorchCudaHalf, LoadedOnlyWhereACudaDriverExists) {
  const bool driver = dlopen("libcuda.so.1", RTLD_LAZY) != nullptr;
  if (driver) {
    EXPECT_EQ(torch_cuda_status(), "loaded");
    EXPECT_TRUE(cuda_half_mapped());
    EXPECT_TRUE(add_has_a_cuda_kernel());
  } else {
    EXPECT_EQ(torch_cuda_status(), "not loaded: no CUDA driver (libcuda.so.1) on this machine");
    EXPECT_FALSE(cuda_half_mapped());
    EXPECT_FALSE(add_has_a_cuda_kernel());
    EXPECT_EQ(cuda_device_count(), 0);
  }

  const std::string self =
      this_program() + " --gtest_filter=TorchCudaHalf.ReportWhatThisProcessLoaded";
  // Forced: the CUDA half is there before main, its kernels registered.
  auto forced = testing::run_command("SCALETRAIN_LOAD_TORCH_CUDA=1 " + self + " 2>&1");
  ASSERT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_NE(forced.output.find("status: loaded\nmapped: 1\ncuda kernels: 1\ncuda hooks: 1\n"),
            std::string::npos)
      << forced.output;
  if (!driver) {
    EXPECT_NE(forced.output.find("nccl module: opened ("), std::string::npos) << forced.output;
  }
  // Refused: never, driver or not.
  auto off = testing::run_command("SCALETRAIN_LOAD_TORCH_CUDA=0 " + self + " 2>&1");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  // Regression (GpusCountedWithoutTheCudaHalf): c10_cuda counted the GPUs, and the trainer chose
  // them, with no CUDA kernel to run on them. Without the CUDA half there are none.
  EXPECT_NE(off.output.find("status: not loaded: SCALETRAIN_LOAD_TORCH_CUDA=0\nmapped: 0\n"
                            "cuda kernels: 0\ncuda hooks: 0\ndevices: 0\n"),
            std::string::npos)
      << off.output;
}

}  // namespace
}  // namespace scaletrain
