#include "scaletrain/secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <openssl/rand.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "scaletrain/error.h"

namespace scaletrain {

// Note [Job secret]: PyTorch's TCPStore, torchrun's rendezvous and TorchFT's lighthouse trust
// whoever reaches their port. Ours ask every connection to prove, before anything else is read,
// that it holds the job's secret (Note [Authenticated connections] in auth.cpp): a challenge and
// a response with HMAC-SHA256, both ways, so that neither side sends the secret nor anything
// derived from it that could be replayed. The secret travels to processes by the environment or
// a file, both readable only by the user who started them.

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

void check_length(const std::string& secret, const std::string& where) {
  if (secret.size() < kMinSecretLength) {
    throw UsageError(fmt::format(
        "{} holds a secret of {} characters, fewer than {}: a short secret can be guessed. Use "
        "a longer one, e.g. `head -c 32 /dev/urandom | xxd -p -c 64`",
        where, secret.size(), kMinSecretLength));
  }
}

// Writes a new secret to `path` without ever showing a partial file: a private temporary file,
// then a hard link to `path`, which fails when another process created it first (that one's
// secret then wins, and is read back).
void create_secret_file(const std::string& path) {
  const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw UsageError(
        fmt::format("cannot create the secret file {}: {}; give {} a path in a "
                    "folder you may write, or set {}",
                    path, strerror(errno), kSecretFileEnv, kSecretEnv));
  }
  const std::string line = generate_secret() + "\n";
  const bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  const bool synced = fsync(fd) == 0;
  close(fd);
  const bool linked = written && synced && link(tmp.c_str(), path.c_str()) == 0;
  const int err = errno;
  unlink(tmp.c_str());
  if (!linked && err != EEXIST) {
    throw UsageError(
        fmt::format("cannot create the secret file {}: {}", path, strerror(written ? err : EIO)));
  }
}

}  // namespace

std::string generate_secret() {
  unsigned char raw[32];
  if (RAND_bytes(raw, sizeof(raw)) != 1) {
    throw Error("cannot draw a random secret: the system's random source failed");
  }
  std::string hex;
  for (unsigned char c : raw) hex += fmt::format("{:02x}", c);
  return hex;
}

namespace {

// The file at `path`, opened without following a symbolic link, and its status: a link planted
// in a folder others may write could otherwise point at any file of the user whose first line
// is predictable (an ssh key's "-----BEGIN ...", regression
// SecretFileFollowedAPlantedSymlink). -1 with errno set when it cannot be opened.
int open_secret(const std::string& path, struct stat* st) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd >= 0 && fstat(fd, st) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// What is wrong with a secret file of status `st` ("" when nothing).
std::string unsafe(const std::string& path, const struct stat& st) {
  if (!S_ISREG(st.st_mode)) return "the secret file " + path + " is not a regular file";
  if (st.st_uid != geteuid()) {
    return fmt::format(
        "the secret file {} belongs to user {}, not to this process's user {}: anyone who can "
        "write it chooses the job's secret. Use a file of your own",
        path, st.st_uid, geteuid());
  }
  if ((st.st_mode & 0077) != 0) {
    return fmt::format(
        "the secret file {} may be read by other users (mode {:04o}): anyone who reads it can "
        "join the job. Make it yours alone: chmod 600 {}",
        path, st.st_mode & 07777, path);
  }
  return "";
}

std::string first_line(int fd) {
  std::string text;
  char buf[4096];
  ssize_t n;
  while (text.find('\n') == std::string::npos && text.size() < 65536 &&
         (n = read(fd, buf, sizeof(buf))) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  return text.substr(0, text.find('\n'));
}

}  // namespace

std::string read_secret_file(const std::string& path, bool create) {
  struct stat st {};
  int fd = open_secret(path, &st);
  if (fd < 0 && errno == ENOENT && create) {
    create_secret_file(path);
    fd = open_secret(path, &st);
  }
  if (fd < 0) {
    throw UsageError(fmt::format(
        "cannot read the secret file {}: {}", path,
        errno == ELOOP ? "it is a symbolic link (give the file itself)" : strerror(errno)));
  }
  const std::string why = unsafe(path, st);
  const std::string line = why.empty() ? first_line(fd) : "";
  close(fd);
  if (!why.empty()) throw UsageError(why);
  const std::string secret = trim(line);
  if (secret.empty()) {
    throw UsageError(
        fmt::format("cannot read a secret from {}: the file is empty or unreadable "
                    "(delete it and a new one is made)",
                    path));
  }
  check_length(secret, "the secret file " + path);
  return secret;
}

std::string user_secret() {
  if (const char* s = std::getenv(kSecretEnv); s != nullptr && *s != '\0') {
    const std::string secret = trim(s);
    check_length(secret, kSecretEnv);
    return secret;
  }
  if (const char* f = std::getenv(kSecretFileEnv); f != nullptr && *f != '\0') {
    return read_secret_file(f, /*create=*/true);
  }
  return "";
}

}  // namespace scaletrain
