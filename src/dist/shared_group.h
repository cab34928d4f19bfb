#pragma once
// A SharedGroup (src/base/shm.h) over the ranks of a Dist (internal, not public API).

#include <memory>
#include <string>

#include "../base/shm.h"
#include "scaletrain/dist.h"

namespace scaletrain {

/// Collective over `dist`: rank 0 makes a segment of `chunk_floats` floats per rank and posts
/// its name under `key` in the store, the other ranks map it, and all agree (a minimum over
/// "mapped it", on the backend) before anyone uses it: every rank gets a group, or none does
/// (ranks on several machines, another PID namespace, no room in /dev/shm). Also none for one
/// rank or a backend other than Gloo. Collective timeout: dist.timeout.
std::unique_ptr<SharedGroup> open_shared_group(const Dist& dist, const std::string& key,
                                               int64_t chunk_floats);

}  // namespace scaletrain
