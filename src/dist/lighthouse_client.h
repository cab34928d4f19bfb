#pragma once
// A connection to the lighthouse's store (internal; fault_tolerance.cpp and lighthouse.cpp).

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <string>

namespace scaletrain {

/// A client of the lighthouse's TCPStore at host:port. Throws Error naming the address and the
/// fix (start the lighthouse first) when it cannot connect within `timeout`.
c10::intrusive_ptr<c10d::TCPStore> lighthouse_client(const std::string& host, int port,
                                                     std::chrono::milliseconds timeout);

}  // namespace scaletrain
