#include "runtime/proc_tree.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace scaletrain::proc {
namespace {

// /proc/<pid>/stat, or "" when the process is gone. Regression ProcStatReadRacedAnExitingWorker:
// a process reaped between the open and the read makes read() fail with ESRCH, and libstdc++'s
// filebuf throws on a failed read whatever the stream's exception mask (`scaletrain run` once
// stopped with "basic_filebuf::underflow error reading the file: No such process").
std::string read_proc_stat(pid_t pid) {
  try {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string s;
    std::getline(in, s);
    return s;
  } catch (const std::exception&) {
    return "";
  }
}

struct Entry {
  pid_t ppid = 0;
  bool zombie = false;
};

// "pid (comm) S ppid ...": comm may hold spaces and parentheses, so read after the last ')'.
bool read_stat(pid_t pid, Entry& e) {
  const std::string s = read_proc_stat(pid);
  if (s.empty()) return false;
  const size_t close = s.rfind(')');
  if (close == std::string::npos || close + 4 >= s.size()) return false;
  char state = s[close + 2];
  e.zombie = state == 'Z' || state == 'X';
  e.ppid = static_cast<pid_t>(std::strtol(s.c_str() + close + 4, nullptr, 10));
  return true;
}

std::unordered_map<pid_t, Entry> all_processes() {
  std::unordered_map<pid_t, Entry> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* de = readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(de->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    Entry e;
    if (read_stat(static_cast<pid_t>(pid), e)) out[static_cast<pid_t>(pid)] = e;
  }
  closedir(d);
  return out;
}

// Every process below `root` with its entry, skipping the subtrees of `keep`.
std::vector<std::pair<pid_t, Entry>> tree(pid_t root, const std::vector<pid_t>& keep) {
  const auto procs = all_processes();
  std::unordered_map<pid_t, std::vector<pid_t>> kids;
  for (const auto& [pid, e] : procs) kids[e.ppid].push_back(pid);
  std::vector<std::pair<pid_t, Entry>> out;
  std::vector<pid_t> todo = {root};
  while (!todo.empty() && out.size() < 100000) {
    const pid_t p = todo.back();
    todo.pop_back();
    for (pid_t c : kids[p]) {
      if (c == root || std::find(keep.begin(), keep.end(), c) != keep.end()) continue;
      out.emplace_back(c, procs.at(c));
      todo.push_back(c);
    }
  }
  return out;
}

}  // namespace

std::vector<pid_t> descendants(pid_t root, const std::vector<pid_t>& keep) {
  std::vector<pid_t> out;
  for (const auto& [pid, e] : tree(root, keep)) {
    if (!e.zombie) out.push_back(pid);
  }
  return out;
}

std::vector<pid_t> children_of_self() {
  std::vector<pid_t> out;
  for (const auto& [pid, e] : all_processes()) {
    if (e.ppid == getpid()) out.push_back(pid);
  }
  return out;
}

int kill_descendants(const std::vector<pid_t>& keep, int rounds) {
  const pid_t self = getpid();
  std::unordered_set<pid_t> killed;
  for (int round = 0; round < rounds; ++round) {
    bool any_live = false;
    for (const auto& [pid, e] : tree(self, keep)) {
      if (e.ppid == self && e.zombie) waitpid(pid, nullptr, WNOHANG);
      if (e.zombie) continue;
      any_live = true;
      if (kill(pid, SIGKILL) == 0) killed.insert(pid);
    }
    if (!any_live) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(round < 10 ? 1 : 10));
  }
  for (const auto& [pid, e] : tree(self, keep)) {  // the last ones killed, now zombies
    if (e.ppid == self) waitpid(pid, nullptr, WNOHANG);
  }
  return static_cast<int>(killed.size());
}

bool is_stopped(pid_t pid) {
  if (pid <= 0) return false;
  const std::string stat = read_proc_stat(pid);
  const auto close = stat.rfind(')');  // the state follows the command's closing parenthesis
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'T' || state == 't';
}

}  // namespace scaletrain::proc
