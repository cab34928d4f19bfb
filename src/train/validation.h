#pragma once
// The trainer's checks of its options before any work (internal): each throws UsageError
// naming the value and the fix.

#include <cstdio>
#include <string>

#include "scaletrain/error.h"
#include "scaletrain/trainer.h"

namespace scaletrain {

inline std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string shown(int64_t v) { return std::to_string(v); }

/// A numeric option outside its range: a UsageError naming the flag, the value and the range.
/// Written as "must be" conditions so that NaN, which fails every comparison, fails them too.
template <typename T>
void require(bool ok, const char* flag, T value, const char* range) {
  if (!ok) throw UsageError(std::string(flag) + " " + shown(value) + " must be " + range);
}

void validate_trainer_numbers(const TrainerOptions& o);
/// The strategy's combinations with the other options and the world.
void validate_strategy(const TrainerOptions& o, int world);
/// The output folder writable, the checkpoint to resume there, no other run's files. (A live run
/// in it is train()'s to refuse, or require_free_output_folder()'s: Note [Folder owner].)
void validate_output(const TrainerOptions& o);

}  // namespace scaletrain
