#include "scaletrain/log.h"

#include <cstdio>
#include <mutex>

namespace scaletrain {
namespace {

std::mutex& sink_mutex() {
  static std::mutex mu;
  return mu;
}

LogSink& current_sink() {
  static LogSink sink = console_log_sink();
  return sink;
}

}  // namespace

LogSink console_log_sink() {
  return [](LogLevel level, const std::string& line) {
    switch (level) {
      case LogLevel::kProgress:
        std::fputs(line.c_str(), stdout);
        std::fflush(stdout);
        break;
      case LogLevel::kInfo:
        std::fprintf(stdout, "%s\n", line.c_str());
        std::fflush(stdout);
        break;
      case LogLevel::kWarning:
        std::fprintf(stderr, "scaletrain: %s\n", line.c_str());
        std::fflush(stderr);
        break;
    }
  };
}

LogSink set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  std::swap(current_sink(), sink);
  return sink;
}

void log_line(LogLevel level, const std::string& line) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  if (!current_sink()) return;
  try {
    current_sink()(level, line);
  } catch (...) {  // a sink's failure loses its line, never the caller's work (destructors log)
  }
}

}  // namespace scaletrain
