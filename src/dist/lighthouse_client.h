#pragma once
// A connection to the lighthouse's store (internal; fault_tolerance.cpp and its tests).

#include <chrono>
#include <string>

#include "dist/auth_store.h"

namespace scaletrain {

/// A client of the lighthouse at host:port that proved `secret`. Throws Error naming the
/// address and the fix (start the lighthouse first) when it cannot connect within `timeout`,
/// UsageError when the lighthouse holds another secret.
c10::intrusive_ptr<AuthStore> lighthouse_client(const std::string& host, int port,
                                                const std::string& secret,
                                                std::chrono::milliseconds timeout);

}  // namespace scaletrain
