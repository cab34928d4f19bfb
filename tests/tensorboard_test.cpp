// TensorBoard event files: the framing and encoding checked by a reader written here, and the
// file read back by TensorBoard's own reader (the project's Python environment has it).

#include "scaletrain/tensorboard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "scaletrain/error.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the check value of CRC-32C
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720, B.4
}

// What a reader gets from one event.
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version, tag;
  float value = 0;
};

// A minimal TFRecord + protobuf reader, independent of the writer's code paths.
struct Reader {
  std::string bytes;
  size_t pos = 0;
  static uint32_t unmask(uint32_t m) {
    uint32_t r = m - 0xa282ead8u;
    return (r >> 17) | (r << 15);
  }
  template <class T>
  static T get(const std::string& s, size_t at) {
    T v;
    std::memcpy(&v, s.data() + at, sizeof(T));
    return v;
  }
  static uint64_t varint(const std::string& s, size_t& at) {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(s.at(at++));
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  // Fields of one message: field number -> raw bytes (length-delimited) or fixed/varint.
  static void parse(const std::string& m, Event& e, int depth) {
    size_t at = 0;
    while (at < m.size()) {
      const uint64_t k = varint(m, at);
      const int field = static_cast<int>(k >> 3), wire = static_cast<int>(k & 7);
      if (wire == 0) {
        const uint64_t v = varint(m, at);
        if (depth == 0 && field == 2) e.step = static_cast<int64_t>(v);
      } else if (wire == 1) {
        if (depth == 0 && field == 1) e.wall_time = get<double>(m, at);
        at += 8;
      } else if (wire == 5) {
        if (depth == 2 && field == 2) e.value = get<float>(m, at);
        at += 4;
      } else if (wire == 2) {
        const auto len = static_cast<size_t>(varint(m, at));
        const std::string sub = m.substr(at, len);
        at += len;
        if (depth == 0 && field == 3) e.file_version = sub;
        if (depth == 0 && field == 5) parse(sub, e, 1);  // summary
        if (depth == 1 && field == 1) parse(sub, e, 2);  // value
        if (depth == 2 && field == 1) e.tag = sub;
      } else {
        throw std::runtime_error("unexpected wire type " + std::to_string(wire));
      }
    }
  }
  std::optional<Event> next() {
    if (pos == bytes.size()) return std::nullopt;
    const auto len = get<uint64_t>(bytes, pos);
    if (unmask(get<uint32_t>(bytes, pos + 8)) != crc32c(bytes.data() + pos, 8))
      throw std::runtime_error("bad length CRC");
    const std::string data = bytes.substr(pos + 12, len);
    if (unmask(get<uint32_t>(bytes, pos + 12 + len)) != crc32c(data.data(), data.size()))
      throw std::runtime_error("bad data CRC");
    pos += 12 + len + 4;
    Event e;
    parse(data, e, 0);
    return e;
  }
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TEST(EventWriter, WritesTheRecordsTensorBoardExpects) {
  testing::TempDir dir("tb");
  fs::path path;
  {
    EventWriter w(dir.path / "run");
    path = w.path();
    w.add_scalar("train/loss", 0.5, 10, 1000.25);
    w.add_scalar("test/accuracy", 0.875, 300);
  }
  const std::string name = path.filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find("." + std::to_string(getpid())), std::string::npos) << name;
  Reader r{slurp(path)};
  auto first = r.next();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->file_version, "brain.Event:2");
  EXPECT_GT(first->wall_time, 1.7e9);
  auto a = r.next(), b = r.next();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->tag, "train/loss");
  EXPECT_EQ(a->step, 10);
  EXPECT_EQ(a->value, 0.5f);
  EXPECT_EQ(a->wall_time, 1000.25);
  EXPECT_EQ(b->tag, "test/accuracy");
  EXPECT_EQ(b->step, 300);
  EXPECT_EQ(b->value, 0.875f);
  EXPECT_FALSE(r.next());
}

TEST(EventWriter, ACorruptByteIsCaughtByTheChecksum) {
  testing::TempDir dir("tb");
  fs::path path;
  {
    EventWriter w(dir.path);
    path = w.path();
    w.add_scalar("x", 1.0, 1);
  }
  std::string bytes = slurp(path);
  bytes[bytes.size() - 6] ^= 0x10;  // inside the last event's data
  Reader r{bytes};
  r.next();
  EXPECT_THROW(r.next(), std::runtime_error);
}

TEST(EventWriter, AnUnwritableFolderIsNamed) {
  testing::TempDir dir("tb");
  std::ofstream(dir.path / "file") << "x";
  try {
    EventWriter w(dir.path / "file" / "logs");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir.path / "file" / "logs").string()), std::string::npos)
        << e.what();
  }
}

// TensorBoard's own reader gets back every scalar (as float32), in order.
TEST(EventWriter, TensorBoardReadsItBack) {
  const std::string python = std::string(VENV_DIR) + "/bin/python";
  auto have = testing::run_command(python + " -c 'import tensorboard' 2>&1");
  ASSERT_EQ(have.exit_code, 0) << "the project's Python environment lacks TensorBoard; run "
                                  "scripts/setup.sh (scripts/requirements-tools.txt): "
                               << have.output;
  testing::TempDir dir("tb");
  {
    EventWriter w(dir.path);
    for (int step = 1; step <= 5; ++step) {
      w.add_scalar("train/loss", 1.0 / step, step * 10);
      if (step % 2 == 0) w.add_scalar("test/accuracy", 0.5 + 0.1 * step, step * 10);
    }
  }
  auto r = testing::run_command(python + " " + testing::script_path("read_tfevents.py") + " " +
                                dir.path.string() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  ASSERT_EQ(j["train/loss"].size(), 5u) << r.output;
  ASSERT_EQ(j["test/accuracy"].size(), 2u) << r.output;
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(j["train/loss"][i][0].get<int>(), (i + 1) * 10);
    // Event files hold float32 scalars: the value read back is the nearest float, exactly.
    EXPECT_EQ(j["train/loss"][i][1].get<double>(), static_cast<float>(1.0 / (i + 1)));
  }
  EXPECT_EQ(j["test/accuracy"][1][1].get<double>(), static_cast<float>(0.5 + 0.1 * 4));
}

}  // namespace
}  // namespace scaletrain
