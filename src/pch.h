// Precompiled LibTorch headers: compiled once, then every TU of the library, the tests and the
// benchmarks loads them in about a second instead of parsing them again (~20 s each).
#pragma once
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
