#pragma once
// The processes below a process, read from /proc, and the sweep that kills them (internal to
// the launcher). Note [Descendants] in src/launch/group.cpp says why the launcher needs it.

#include <sys/types.h>

#include <vector>

namespace scaletrain::proc {

/// The live (not yet zombie) processes below `root`, leaving out the subtrees of `keep`.
/// Follows parent links in /proc, so it finds processes that left `root`'s process group or
/// session (setsid) as long as they are re-parented within the tree (a subreaper).
std::vector<pid_t> descendants(pid_t root, const std::vector<pid_t>& keep = {});

/// This process's children (live or zombie), for the launcher to know which were not its own.
std::vector<pid_t> children_of_self();

/// SIGKILLs every live descendant of this process except the subtrees of `keep`, again and
/// again until none is left (a process may fork while it is being killed; at most `rounds`
/// passes), and reaps those that became its own zombie children. Returns how many it killed.
int kill_descendants(const std::vector<pid_t>& keep = {}, int rounds = 100);

/// Whether process `pid` (of this PID namespace) is stopped by a signal (SIGSTOP, SIGTSTP, a
/// debugger): state T or t in /proc/<pid>/stat. False for a process that is not there.
bool is_stopped(pid_t pid);

}  // namespace scaletrain::proc
