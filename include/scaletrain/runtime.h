#pragma once
// Process-wide settings that make CPU training faster. The `scaletrain` tool applies them at
// start; programs using the library call them from main().

namespace scaletrain {

/// Note [Allocator]: glibc returns large freed blocks (activations, gradients) to the kernel
/// at once, so every training step faults the same memory back in page by page — on LeNet with
/// batch 128 that was ~20% of a CPU step. This keeps blocks up to 256 MB in the heap and trims
/// it only past 1 GB free. Environment variables MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_
/// set by the user win.
void tune_cpu_allocator();

}  // namespace scaletrain
