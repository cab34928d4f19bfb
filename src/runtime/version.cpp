#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/version.h>

#include "runtime/torch_cuda.h"
#include "scaletrain/version.h"

#ifdef SCALETRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace scaletrain {

std::string version() { return SCALETRAIN_VERSION; }

std::string libtorch_version() { return TORCH_VERSION; }

bool built_with_cuda() {
#ifdef SCALETRAIN_WITH_NCCL
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
  // No GPU is usable without LibTorch's CUDA half (Note [CUDA half on demand]), although c10_cuda,
  // always linked, registers the CUDA device guard and would count the GPUs.
  if (!torch_cuda_loaded()) return 0;
  // Asks the CUDA device-guard implementation (c10_cuda's); 0 devices on a machine without a GPU.
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return 0;
  return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount());
}

std::string cuda_device_name(int index) {
#ifdef SCALETRAIN_WITH_CUDA
  cudaDeviceProp p{};
  if (index >= 0 && index < cuda_device_count() &&
      cudaGetDeviceProperties(&p, index) == cudaSuccess)
    return p.name;
#endif
  (void)index;
  return "";
}

}  // namespace scaletrain
