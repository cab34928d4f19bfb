// Opens libscaletrain_nccl.so, NCCL's process group (src/dist/nccl_backend.cpp), beside the
// library (Note [CUDA half on demand] in src/runtime/torch_cuda.cpp).

#include "dist/nccl_module.h"

#include <dlfcn.h>

#include <string>

#include "runtime/torch_cuda.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"

namespace scaletrain {

NcclFactory nccl_factory() {
  static NcclFactory factory = [] {
    const std::string folder = scaletrain_library_folder();
    if (folder.empty()) {
      throw Error(
          "backend 'nccl': cannot find the folder of libscaletrain to open its NCCL module");
    }
    const std::string path = folder + "/libscaletrain_nccl.so";
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      throw Error("backend 'nccl': cannot open " + path + " (" + (e ? e : "unknown error") +
                  "); LibTorch's CUDA half is " + torch_cuda_status());
    }
    auto* f = reinterpret_cast<NcclFactory>(dlsym(h, "scaletrain_make_nccl_backend"));
    if (f == nullptr)
      throw Error("backend 'nccl': " + path + " has no scaletrain_make_nccl_backend");
    return f;
  }();
  return factory;
}

}  // namespace scaletrain
