// LibTorch's CUDA half, loaded when this machine can run CUDA (Note [CUDA half on demand]).

#include <dlfcn.h>
#include <limits.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/torch_cuda.h"

#include "scaletrain/version.h"

// Note [CUDA half on demand]
// LibTorch's CUDA build comes in two halves: libtorch_cpu (every operator, the CPU kernels) and
// libtorch_cuda (the CUDA kernels, NCCL, and through them cuBLAS, cuDNN, cuFFT, cuSPARSE... about
// a gigabyte of libraries). A program linked to both maps and relocates them all when it starts:
// 0.37 s of processor time and 50,000 page faults for a program that does nothing, against 0.24
// s and 16,000 without the CUDA half (perf stat, 2 cores, Intel Xeon). Each rank of a CPU job
// pays it again.
//
// The library therefore links libtorch_cpu, c10 and c10_cuda (the small CUDA runtime wrappers:
// streams, the device guard) but not libtorch_cuda, and loads libtorch_cuda itself while the
// program starts (a constructor of this library of the first priority, before its own static
// objects and the program's) when the CUDA driver (libcuda.so.1) can be loaded: where it cannot,
// no CUDA call can succeed, with the CUDA half or without it. The load must come before anything
// asks LibTorch about CUDA: LibTorch looks up its CUDA hooks once, and a process that asked
// before libtorch_cuda was there has no CUDA for good. SCALETRAIN_LOAD_TORCH_CUDA=1 loads it
// without a driver, =0 never; a program that links libtorch_cuda itself has it either way.
// Without the CUDA half the library counts no GPU (cuda_device_count(): c10_cuda alone would
// count them, with no kernel to run on them), and the command line warns when a load failed.
//
// NCCL's process group lives in libtorch_cuda, so the library builds it in a module of its own
// (libscaletrain_nccl.so, beside libscaletrain.so), opened the first time a group asks for it
// (src/dist/nccl_module.h).

namespace scaletrain {
namespace {

std::string& cuda_half_status() {
  static std::string s = "not loaded";
  return s;
}

// The folder of the loaded library whose handle is `h` ("" when unknown).
std::string folder_of_library(void* h) {
  char dir[PATH_MAX] = {0};
  if (h == nullptr || dlinfo(h, RTLD_DI_ORIGIN, dir) != 0) return "";
  return dir;
}

// The folder of libscaletrain itself, absolute (a relative LD_LIBRARY_PATH entry is resolved
// here, before the program can change its working folder).
std::string& library_folder() {
  static std::string s;
  return s;
}

void load_torch_cuda() {
  Dl_info self{};
  char real[PATH_MAX] = {0};
  if (dladdr(reinterpret_cast<void*>(&load_torch_cuda), &self) != 0 && self.dli_fname != nullptr &&
      realpath(self.dli_fname, real) != nullptr) {
    const std::string path = real;
    library_folder() = path.substr(0, path.find_last_of('/'));
  }
#ifdef SCALETRAIN_WITH_CUDA
  // Linked by the program itself (a project that links TORCH_LIBRARIES): there already.
  if (dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD) != nullptr) {
    cuda_half_status() = "loaded";
    return;
  }
  const char* want = std::getenv("SCALETRAIN_LOAD_TORCH_CUDA");
  const std::string choice = want == nullptr ? "" : want;
  if (choice == "0") {
    cuda_half_status() = "not loaded: SCALETRAIN_LOAD_TORCH_CUDA=0";
    return;
  }
  if (choice != "1" && dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) == nullptr) {
    cuda_half_status() = "not loaded: no CUDA driver (libcuda.so.1) on this machine";
    return;
  }
  // Beside libtorch_cpu, wherever that was found.
  const std::string dir = folder_of_library(dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD));
  const std::string path = (dir.empty() ? "" : dir + "/") + "libtorch_cuda.so";
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    const char* e = dlerror();
    cuda_half_status() = "failed to load " + path + ": " + (e ? e : "unknown error");
    return;
  }
  cuda_half_status() = "loaded";
#else
  cuda_half_status() = "not loaded: this scaletrain was built against a LibTorch without CUDA";
#endif
}

// Before the library's other static objects (priority 101: the first a program may use), so
// that nothing of the library can ask LibTorch about CUDA before the CUDA half is there.
__attribute__((constructor(101))) void load_cuda_half_at_start() { load_torch_cuda(); }

}  // namespace

std::string torch_cuda_status() { return cuda_half_status(); }

bool torch_cuda_loaded() { return cuda_half_status() == "loaded"; }

std::string scaletrain_library_folder() { return library_folder(); }

}  // namespace scaletrain
