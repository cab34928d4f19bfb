#include "transport/segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>

#include "scaletrain/error.h"

namespace scaletrain {
namespace shm {
namespace {

void* map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // std::atomic<uint32_t> is a lock-free 4-byte word: the futex waits on its address.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

Segment create(size_t bytes) {
  std::random_device rd;
  std::ostringstream n;
  // The creator's pid and PID namespace: a launcher removes a dead worker's segments by them
  // (remove_segments_of), never those of a process with the same pid in another namespace
  // that shares this /dev/shm (containers).
  n << "/scaletrain-" << getpid() << "-" << pid_namespace() << "-" << std::hex << rd() << rd();
  const std::string name = n.str();
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error("shm_open " + name + ": " + std::strerror(errno));
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = err == 0 ? map(fd, bytes) : nullptr;
  ::close(fd);
  if (!base) {
    shm_unlink(name.c_str());
    throw Error("cannot make a " + std::to_string(bytes) + "-byte shared segment " + name + ": " +
                std::strerror(err != 0 ? err : errno));
  }
  return {name, base, bytes};
}

Segment open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw Error("shm_open " + name + " (another machine?): " + std::strerror(errno));
  struct stat st {};
  void* base =
      fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes ? map(fd, bytes) : nullptr;
  ::close(fd);
  if (!base) throw Error("shared segment " + name + " is not the size this group needs");
  return {name, base, bytes};
}

void close(const Segment& segment) { munmap(segment.base, segment.bytes); }

int remove_segments_of(int pid) {
  if (pid <= 0) return 0;
  const std::string prefix =
      "scaletrain-" + std::to_string(pid) + "-" + std::to_string(pid_namespace()) + "-";
  std::error_code ec;
  int removed = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = e.path().filename().string();
    if (file.rfind(prefix, 0) == 0 && shm_unlink(("/" + file).c_str()) == 0) ++removed;
  }
  return removed;
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

bool exited(int pid) { return pid > 0 && pid != getpid() && kill(pid, 0) != 0 && errno == ESRCH; }

void wait(std::atomic<uint32_t>* word, uint32_t value, const timespec& nap) {
  futex(word, FUTEX_WAIT, value, &nap);
}

void wake(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

}  // namespace shm
}  // namespace scaletrain
