#pragma once
// The elastic launcher (internal): launch() for `--nnodes MIN:MAX` (Note [Elastic rendezvous]).

#include "scaletrain/launch.h"

namespace scaletrain::launch_detail {

/// Runs this node's part of an elastic job: joins rounds at the rendezvous, runs the workers of
/// each round's world, and joins again when the round ends (a node left, failed or joined).
/// Returns as launch() does.
int launch_elastic(const LaunchOptions& options);

}  // namespace scaletrain::launch_detail
