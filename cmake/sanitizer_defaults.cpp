// Default options of the sanitizer runtimes, compiled into every executable of a
// -DSCALETRAIN_SANITIZE=ON build (tests, the CLI, benchmarks), so that they apply however the
// program is started (ctest, test discovery, the launcher's workers).
extern "C" {

// LibTorch and its dependencies are not instrumented: container-overflow annotations would be
// one-sided, and their one-time allocations (kernel registries, thread pools) live until exit.
const char* __asan_default_options() {
  return "detect_container_overflow=0:detect_odr_violation=0:abort_on_error=0";
}

const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }

// Leaks are reported for our own code; allocations made inside these libraries are not ours.
const char* __lsan_default_suppressions() {
  return "leak:libtorch_cpu.so\nleak:libtorch.so\nleak:libc10.so\nleak:libtorch_cuda.so\n"
         "leak:libc10_cuda.so\nleak:libgomp\nleak:libcudart\nleak:libnccl\nleak:libcuda\n"
         "leak:libnvrtc\nleak:libcublas\nleak:libcudnn\n";
}
}
