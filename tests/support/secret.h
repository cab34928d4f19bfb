#pragma once
// The job's secret of the tests' processes and lighthouses (secret.h): a fixed one, so that a
// test's threads and the programs it starts agree without a file.

namespace scaletrain::testing {

inline constexpr const char* kTestSecret = "scaletrain-tests-secret-0123456789";

}  // namespace scaletrain::testing
