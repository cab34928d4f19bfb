#pragma once
// NCCL's process group from its own module, libscaletrain_nccl.so (Note [CUDA half on demand] in
// src/runtime/torch_cuda.cpp).

#include <cstdint>
#include <string>

namespace c10d {
class Store;
class Backend;
}  // namespace c10d

namespace scaletrain {

/// Builds NCCL's process group of `size` ranks, this one `rank`, over `store` (borrowed), with
/// its collectives' `timeout_ms`. Returns an owning pointer (c10::intrusive_ptr's reclaim), or
/// null with the reason in `*error`.
using NcclFactory = c10d::Backend* (*)(c10d::Store* store, int rank, int size, int64_t timeout_ms,
                                       std::string* error);

/// The factory of libscaletrain_nccl.so (beside libscaletrain.so), opened on the first call;
/// throws Error when the module cannot be opened.
NcclFactory nccl_factory();

}  // namespace scaletrain
