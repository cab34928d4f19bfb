#pragma once
// Atomic file writes (internal): a temporary file of the writer's own, flushed to the disk,
// then renamed over the target, so a reader sees the old file or the new one, never a part.
// Every writer has its own temporary name (process, thread and a count), so writers of one
// path at once never collide (the last rename wins whole), and a failed write removes its
// temporary before it throws: nothing but the target is ever left.

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

namespace scaletrain {

/// The temporary path a write of `path` uses: `path` + ".<pid>-<n>.tmp".
std::string temporary_path(const std::string& path);

/// Removes from `dir` the temporaries whose names start with `prefix` that a writer which is
/// gone left behind (killed mid-write): `<file>.<pid>-<n>.tmp` (a file, or the folder of a DCP
/// checkpoint with all in it) whose pid is no live process here and that were last written
/// `min_age` ago or more (a writer on another host sharing the folder keeps its own). Returns how
/// many it removed; never throws.
int remove_stale_temporaries(const std::string& dir, const std::string& prefix,
                             std::chrono::seconds min_age = std::chrono::seconds(60));

/// Writes `bytes` to `path` atomically and durably (file and folder synced). Throws Error naming
/// `what` and `path` (and the fix: a writable folder, space on the disk) on any failure, with
/// the temporary file removed. `before_rename`, when set, is called with the temporary's path once
/// it is written and synced, just before the rename (a test of a crash at that moment).
void write_atomically(const std::string& path, std::string_view bytes, const std::string& what,
                      const std::function<void(const std::string&)>& before_rename = nullptr);

}  // namespace scaletrain
