#include "runtime/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

std::atomic<uint64_t> g_count{0};

// Writes all of `bytes` to `fd`; false on a failure (errno tells).
bool write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

}  // namespace

std::string temporary_path(const std::string& path) {
  return path + "." + std::to_string(::getpid()) + "-" + std::to_string(g_count++) + ".tmp";
}

int remove_stale_temporaries(const std::string& dir, const std::string& prefix,
                             std::chrono::seconds min_age) {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name.size() < 5 ||
        name.compare(name.size() - 4, 4, ".tmp") != 0) {
      continue;
    }
    const auto dash = name.rfind('-'), dot = name.rfind('.', dash);
    if (dash == std::string::npos || dot == std::string::npos) continue;
    const long pid = std::strtol(name.c_str() + dot + 1, nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 ||
        errno != ESRCH) {
      continue;  // ours, or a live process's (EPERM: alive, another user's)
    }
    std::error_code time_ec;
    const auto written = fs::last_write_time(it->path(), time_ec);
    if (time_ec || now - written < min_age) continue;
    if (fs::remove_all(it->path(), time_ec) > 0) ++removed;  // a folder's too (DCP's)
  }
  return removed;
}

void write_atomically(const std::string& path, std::string_view bytes, const std::string& what,
                      const std::function<void(const std::string&)>& before_rename) {
  const std::string tmp = temporary_path(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error("cannot write " + what + " '" + path + "' (" + std::strerror(errno) +
                "): check that the folder exists and is writable");
  }
  const bool written = write_all(fd, bytes) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (written && before_rename) before_rename(tmp);
  if (!written || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int cause = written ? errno : err;
    ::unlink(tmp.c_str());
    throw Error("writing " + what + " '" + path + "' failed (" + std::strerror(cause) +
                (cause == ENOSPC ? "): the disk is full; free space and run again"
                                 : "): check the folder and the disk"));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // make the rename itself durable
    ::close(dfd);
  }
}

}  // namespace scaletrain
