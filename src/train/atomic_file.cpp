#include "train/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
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
