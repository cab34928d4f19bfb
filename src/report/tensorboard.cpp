#include "scaletrain/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "scaletrain/error.h"

namespace scaletrain {

namespace {

constexpr std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected
    t[i] = c;
  }
  return t;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

// Protocol-buffer wire format, the few pieces an Event needs.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void key(std::string& out, int field, int wire) {
  varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire));
}
template <class T>
void fixed(std::string& out, T v) {  // little-endian, as x86 and ARM store it
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string event(double wall_time, int64_t step) {
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static constexpr auto table = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

EventWriter::EventWriter(const std::filesystem::path& log_dir, const std::string& suffix) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const auto secs = static_cast<long long>(now());
  path_ = log_dir / ("events.out.tfevents." + std::to_string(secs) + "." + host + "." +
                     std::to_string(getpid()) + suffix);
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) {
    throw Error("cannot create the TensorBoard event file '" + path_.string() +
                "': " + std::strerror(errno) + "; choose a writable folder");
  }
  std::string e = event(now(), 0);
  bytes_field(e, 3, "brain.Event:2");
  write_record(e);
}

EventWriter::~EventWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void EventWriter::add_scalar(const std::string& tag, double value, int64_t step,
                             std::optional<double> wall_time) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string v;
  bytes_field(v, 1, tag);
  key(v, 2, 5);
  fixed(v, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  std::string e = event(wall_time.value_or(now()), step);
  bytes_field(e, 5, summary);
  write_record(e);
}

void EventWriter::write_record(const std::string& data) {
  std::string rec;
  const uint64_t len = data.size();
  fixed(rec, len);
  fixed(rec, masked(crc32c(rec.data(), 8)));
  rec += data;
  fixed(rec, masked(crc32c(data.data(), data.size())));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0) {
    throw Error("cannot write the TensorBoard event file '" + path_.string() +
                "': " + std::strerror(errno));
  }
}

}  // namespace scaletrain
