#pragma once
// Where the library's words go. The library writes nothing to the terminal by itself: each line
// it has for a person (a resume's notes, a damaged checkpoint skipped, the trainer's progress and
// epoch lines) goes to one sink per process, which the program sets. The console is the sink
// until a program sets another; nullptr silences the library.
//
//   scaletrain::set_log_sink([&](scaletrain::LogLevel level, const std::string& line) {
//     if (level != scaletrain::LogLevel::kProgress) my_logger.info(line);
//   });

#include <functional>
#include <string>

namespace scaletrain {

enum class LogLevel {
  kProgress,  // a progress display's update, meant to be written as is: a terminal's bar begins
              // with '\r' and ends a line only when done; other lines end with '\n'
  kInfo,      // a line of what happened (resumed from, what differs from the checkpoint)
  kWarning,   // something skipped or lost that the run survived (a damaged checkpoint)
};

/// A line without its end ('\n'), except for kProgress (above).
using LogSink = std::function<void(LogLevel level, const std::string& line)>;

/// Sets the process's sink and returns the one it replaces. Thread-safe; the sink is called under
/// a lock, one line at a time, from any thread of the library, so it must not call log_line() or
/// set_log_sink() itself. An exception it throws is swallowed (that line is lost): the library
/// also logs from destructors.
LogSink set_log_sink(LogSink sink);

/// The default sink: kProgress as is and kInfo with a '\n' on standard output, kWarning as
/// "scaletrain: <line>" on standard error.
LogSink console_log_sink();

/// Gives a line to the process's sink (nothing when it is nullptr).
void log_line(LogLevel level, const std::string& line);

}  // namespace scaletrain
