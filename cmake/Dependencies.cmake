# Third-party dependencies. LibTorch comes from the project's virtual environment (.venv, made by
# scripts/setup.sh) unless the user points Torch_DIR or CMAKE_PREFIX_PATH at another LibTorch, or
# a parent project already found one.
if(NOT TARGET torch)
  file(GLOB _venv_torch_cmake "${PROJECT_SOURCE_DIR}/.venv/lib/python3*/site-packages/torch/share/cmake")
  if(_venv_torch_cmake AND NOT Torch_DIR)
    list(APPEND CMAKE_PREFIX_PATH ${_venv_torch_cmake})
  endif()
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING "CUDA architectures for our own CUDA code")
  endif()
  get_property(_before DIRECTORY PROPERTY IMPORTED_TARGETS)
  find_package(Torch REQUIRED)
  find_package(Threads REQUIRED)
  # Imported targets are visible in this folder only; the scaletrain target names LibTorch's in
  # its usage requirements, so a parent project (add_subdirectory, FetchContent) must see them.
  if(NOT SCALETRAIN_TOP_LEVEL)
    get_property(_after DIRECTORY PROPERTY IMPORTED_TARGETS)
    list(REMOVE_ITEM _after ${_before})
    foreach(_t IN LISTS _after)
      set_property(TARGET ${_t} PROPERTY IMPORTED_GLOBAL TRUE)
    endforeach()
  endif()
endif()
find_package(Threads REQUIRED)

# Is this LibTorch built with CUDA? Then every CUDA path of ours compiles and links, even on a
# machine without a GPU; it only runs where one exists.
set(SCALETRAIN_HAVE_CUDA OFF)
if(TARGET torch_cuda OR EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so")
  set(SCALETRAIN_HAVE_CUDA ON)
endif()
message(STATUS "scaletrain: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}, CUDA: ${SCALETRAIN_HAVE_CUDA}")

# What the library links of LibTorch: its CPU half (every operator), c10 and c10_cuda, but not
# libtorch_cuda, which it loads at start where a CUDA driver exists (Note [CUDA half on demand],
# src/runtime/torch_cuda.cpp). A LibTorch without these targets: all of it, as before.
if(TARGET torch_cpu_library AND TARGET c10)
  set(SCALETRAIN_TORCH_LINK torch_cpu_library c10)
  if(SCALETRAIN_HAVE_CUDA AND TARGET c10_cuda)
    list(APPEND SCALETRAIN_TORCH_LINK c10_cuda)
  endif()
else()
  set(SCALETRAIN_TORCH_LINK ${TORCH_LIBRARIES})
endif()

# Runtime search path of the library and the tools: LibTorch's own libraries, the CUDA libraries
# the pip wheels add beside it (nvidia/*/lib), and the CUDA toolkit's. Binaries then run without
# LD_LIBRARY_PATH, from the build tree and installed.
file(GLOB _nvidia_libs "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
set(SCALETRAIN_RPATH "${TORCH_INSTALL_PREFIX}/lib" ${_nvidia_libs})
foreach(_d /usr/local/cuda/lib64 /usr/local/cuda/lib)
  if(EXISTS ${_d})
    list(APPEND SCALETRAIN_RPATH ${_d})
  endif()
endforeach()

# gloo headers (Debian's libgloo-dev) for c10d's ProcessGroupGloo declaration (private to the
# library: no public header needs them).
find_path(GLOO_INCLUDE_DIR gloo/algorithm.h REQUIRED)
# nccl.h for c10d's ProcessGroupNCCL declaration.
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include ${CUDAToolkit_INCLUDE_DIRS})

# The library's own (private) dependencies; the tool's and the tests' are found where they are
# built (cli/, tests/), so that a library-only build needs none of them.
find_package(nlohmann_json REQUIRED)
find_package(spdlog REQUIRED)
find_package(ZLIB REQUIRED)
# HMAC-SHA256 and the random source of the job's secret (Note [Authenticated connections]).
find_package(OpenSSL REQUIRED COMPONENTS Crypto)

# Note [libstdc++ first]: the PyPI libtorch.so exports its own copy of std::filesystem (64
# functions, from the toolchain it was built with), and some of them crash when called from other
# code (std::filesystem::remove_all jumps through a null pointer). The dynamic linker binds each
# symbol to the first library in an executable's NEEDED list that defines it, so every
# executable that links LibTorch must list libstdc++ first. The shared library is named by its
# full path: a bare -lstdc++ can find the static archive, which adds nothing to NEEDED. The
# scaletrain target carries this in its INTERFACE link options (src/CMakeLists.txt, and
# scaletrainConfig.cmake for an installed package, computed with the consumer's compiler), so
# that every program linking scaletrain gets it.
function(scaletrain_libstdcxx_first out)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
    OUTPUT_VARIABLE _lib OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${_lib}" OR NOT EXISTS "${_lib}")
    set(_lib -lstdc++)
  endif()
  set(${out} "LINKER:--push-state,--no-as-needed" "${_lib}" "LINKER:--pop-state" PARENT_SCOPE)
endfunction()
scaletrain_libstdcxx_first(SCALETRAIN_LIBSTDCXX_FIRST)
