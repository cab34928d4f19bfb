#include "scaletrain/runtime.h"

#include <malloc.h>

#include <cstdlib>

namespace scaletrain {

void tune_cpu_allocator() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 256 << 20);
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace scaletrain
