#pragma once
// The store's frames on the wire (internal; Note [Store protocol] in store_server.cpp). No
// LibTorch: the server side is built without it.

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace scaletrain::store_wire {

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,  // waits until the key exists
  kAdd = 3,
  kCheck = 4,
  kWait = 5,  // waits until every key exists
  kDelete = 6,
  kNumKeys = 7,
  kCompareSet = 8,
  kAppend = 9,
  kMultiGet = 10,  // waits until every key exists
  kMultiSet = 11,
};

/// The most bytes one frame may carry: a peer announcing more is cut off.
constexpr uint32_t kMaxFrame = 256u << 20;

/// A frame: its length (4 bytes, little-endian, not counting itself), a code (an Op for a
/// request; 0 ok or 1 error for a reply), the number of strings, then each string's length and
/// bytes.
inline std::string frame(uint8_t code, const std::vector<std::string>& parts) {
  std::string body(1, static_cast<char>(code));
  auto put32 = [&body](uint32_t v) {
    for (int i = 0; i < 4; ++i) body += static_cast<char>((v >> (8 * i)) & 0xff);
  };
  put32(static_cast<uint32_t>(parts.size()));
  for (const auto& p : parts) {
    put32(static_cast<uint32_t>(p.size()));
    body += p;
  }
  std::string out;
  const auto n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

inline uint32_t get32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  return v;
}

struct Message {
  uint8_t code = 0;
  std::vector<std::string> parts;
};

enum class Parse { kIncomplete, kOk, kBad };

/// Takes one whole frame from the start of `buf` into `m`. kBad: a frame past kMaxFrame or one
/// whose strings overrun it (the connection is then given up).
inline Parse take_frame(std::string& buf, Message* m) {
  if (buf.size() < 4) return Parse::kIncomplete;
  const uint32_t n = get32(buf, 0);
  if (n > kMaxFrame || n < 5) return Parse::kBad;
  if (buf.size() < 4 + static_cast<size_t>(n)) return Parse::kIncomplete;
  m->code = static_cast<uint8_t>(buf[4]);
  m->parts.clear();
  const size_t end = 4 + static_cast<size_t>(n);
  const uint32_t count = get32(buf, 5);
  size_t at = 9;
  for (uint32_t i = 0; i < count; ++i) {
    if (at + 4 > end) return Parse::kBad;
    const uint32_t len = get32(buf, at);
    at += 4;
    if (len > end - at) return Parse::kBad;
    m->parts.emplace_back(buf, at, len);
    at += len;
  }
  if (at != end) return Parse::kBad;
  buf.erase(0, end);
  return Parse::kOk;
}

}  // namespace scaletrain::store_wire
