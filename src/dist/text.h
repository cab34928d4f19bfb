#pragma once
// Text helpers of the distributed parts (internal): store values as text, durations in messages,
// and one string agreed over a group.

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace scaletrain {

class Dist;

namespace dist_text {

/// "1.5 s".
inline std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream s;
  s << static_cast<double>(t.count()) / 1000.0 << " s";
  return s.str();
}

inline std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
inline std::vector<uint8_t> bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

/// Rank 0's `mine`, on every rank of `d` (the length, then the bytes, on the backend's device);
/// `what` names the two broadcasts in a timeout's message.
std::string broadcast_text(const Dist& d, const std::string& mine, const std::string& what);

}  // namespace dist_text
}  // namespace scaletrain
