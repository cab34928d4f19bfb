// libscaletrain_nccl.so: NCCL's process group, built in a module of its own because it lives in
// libtorch_cuda, which the library loads only where CUDA can run (Note [CUDA half on demand] in
// src/runtime/torch_cuda.cpp). src/dist/process_group.cpp opens it through nccl_factory().

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>
#include <exception>
#include <string>

extern "C" __attribute__((visibility("default"))) c10d::Backend* scaletrain_make_nccl_backend(
    c10d::Store* store, int rank, int size, int64_t timeout_ms, std::string* error) {
  try {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(store), rank, size, opts);
    return group.release();
  } catch (const c10::Error& e) {
    *error = e.what_without_backtrace();
    return nullptr;
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}
