// How the command line's error line reaches its reader when the process is stopped at the same
// moment (cli/app.cpp), through the real binary.

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "support/subprocess.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// Whether `pid` waits in a write(2) to its standard error (/proc/<pid>/syscall: number 1 on
// x86-64, first argument fd 2); nullopt where the kernel does not say.
std::optional<bool> writing_to_stderr(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/syscall");
  std::string number, fd;
  if (!(in >> number)) return std::nullopt;
  return number == "1" && in >> fd && fd == "0x2";  // "running": on a processor, in no call
}

// Regression: when the rendezvous host died, a rank failed (its peer was gone) and its launcher
// stopped it (SIGTERM) at the same moment; it had written "scaletrain: error: " and was killed
// before the message, which went out in a second write: an empty error line. The line now goes
// out in one write, and a SIGTERM meanwhile takes effect once it is out. The moment is made
// here: the reader's pipe has room for "scaletrain: error: " only, so the old first write fit
// and the second waited; the test stops the process while it waits, then reads the pipe.
TEST(CliErrors, EmptyErrorLineWhenTheRendezvousHostDied) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "reads x86-64's syscall numbers";
#endif
  const fs::path dir =
      fs::temp_directory_path() / ("scaletrain_cli_errors_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "out" / "train.bin" / "in-the-way");  // the rename onto it fails
  std::ofstream(dir / "in.txt") << std::string(3000, 'x');
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  const int capacity = fcntl(p[1], F_GETPIPE_SZ);
  ASSERT_GT(capacity, 0);
  const std::string prefix = "scaletrain: error: ";
  const std::string filler(static_cast<size_t>(capacity) - prefix.size(), '.');
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  ASSERT_EQ(write(p[1], filler.data(), filler.size()), static_cast<ssize_t>(filler.size()));
  fcntl(p[1], F_SETFL, 0);
  const std::string cli = testing::cli_path(), in = (dir / "in.txt").string(),
                    out = (dir / "out").string();
  const pid_t child = fork();
  if (child == 0) {
    dup2(p[1], STDERR_FILENO);
    execl(cli.c_str(), cli.c_str(), "data", "text", "--input", in.c_str(), "--out", out.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(p[1]);
  bool waiting = false;
  for (int i = 0; i < 600 && !waiting; ++i) {  // its start (LibTorch's load) takes a second
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto w = writing_to_stderr(child);
    if (!w) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
      GTEST_SKIP() << "/proc/<pid>/syscall is not readable here";
    }
    waiting = *w;
  }
  ASSERT_TRUE(waiting) << "the command never wrote its error";
  kill(child, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::string got;
  char buf[65536];
  for (ssize_t n; (n = read(p[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
  close(p[0]);
  int status = 0;
  waitpid(child, &status, 0);
  fs::remove_all(dir);
  ASSERT_GE(got.size(), filler.size());
  EXPECT_EQ(got.substr(filler.size()), prefix + "writing token file '" + out +
                                           "/train.bin' failed (Is a directory): check the "
                                           "folder and the disk\n");
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM)
      << "the stop still takes effect, after the line (status " << status << ")";
}

}  // namespace
}  // namespace scaletrain
