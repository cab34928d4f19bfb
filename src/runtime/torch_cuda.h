#pragma once
// LibTorch's CUDA half on demand (Note [CUDA half on demand] in torch_cuda.cpp), inside the
// library. torch_cuda_status() (scaletrain/version.h) is the public face.

#include <string>

namespace scaletrain {

/// Whether libtorch_cuda is in this process (loaded by the library, or linked by the program).
bool torch_cuda_loaded();

/// The absolute folder libscaletrain.so was loaded from ("" when unknown): its modules sit there.
std::string scaletrain_library_folder();

}  // namespace scaletrain
