#pragma once
// TensorBoard event files, written without TensorFlow or a protobuf library: scalars, as
// torch.utils.tensorboard.SummaryWriter.add_scalar writes them.
//
//   scaletrain::EventWriter tb("runs/lenet");   //
//   runs/lenet/events.out.tfevents.<time>.<host>.<pid> tb.add_scalar("train/loss", 0.61, 50);
//   // tensorboard --logdir runs
//
// Format: a TFRecord file (per record: length, masked CRC-32C of the length, an Event protocol
// buffer, masked CRC-32C of it); the first event names the file version "brain.Event:2". Each
// add_scalar is flushed to the operating system, so a crash loses nothing already added.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

namespace scaletrain {

class EventWriter {
 public:
  /// Creates `log_dir` if needed and a new event file in it. Throws Error naming the path when
  /// it cannot.
  explicit EventWriter(const std::filesystem::path& log_dir, const std::string& suffix = "");
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  /// One scalar; `wall_time` in seconds since the epoch, now by default.
  void add_scalar(const std::string& tag, double value, int64_t step,
                  std::optional<double> wall_time = {});
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

/// CRC-32C (Castagnoli), as TFRecord frames use it.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace scaletrain
