#pragma once
// Versions of scaletrain and of the LibTorch it was built against.

#include <string>

namespace scaletrain {

/// scaletrain's version, "MAJOR.MINOR.PATCH".
std::string version();

/// The LibTorch version scaletrain was built against, e.g. "2.11.0".
std::string libtorch_version();

/// Whether LibTorch was built with CUDA, and how many GPUs are visible now (0 without one).
bool built_with_cuda();
int cuda_device_count();

/// Whether LibTorch's CUDA half (libtorch_cuda) was loaded when the program started: "loaded", or
/// "not loaded: <why>" (no CUDA driver on this machine; SCALETRAIN_LOAD_TORCH_CUDA=0), or "failed
/// to load <path>: <reason>". The library loads it only where a CUDA driver exists, so that CPU
/// processes start without mapping the CUDA libraries (SCALETRAIN_LOAD_TORCH_CUDA=1 forces it).
std::string torch_cuda_status();

/// The name of CUDA device `index` ("NVIDIA H100 80GB HBM3"), "" when there is none.
std::string cuda_device_name(int index);

}  // namespace scaletrain
