// The small process between the launcher and each worker (Note [Guardian]).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "launch/group.h"
#include "runtime/proc_tree.h"

namespace scaletrain::launch_detail {
namespace {

// Note [Guardian]: each worker runs under a tiny guardian process, the leader of the worker's
// process group and a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the program starts and
// leaves behind — a double fork, a `setsid` daemon that left the group — is re-parented to the
// guardian while it lives. When the launcher dies, even by SIGKILL, the kernel sends the guardian
// SIGUSR2 (PR_SET_PDEATHSIG): it kills the program, then every process below itself, then its
// whole group. Otherwise the guardian waits for the program and exits the way it did; what the
// program left behind is then re-parented to the launcher (Note [Descendants]).
volatile sig_atomic_t g_launcher_died = 0;
volatile sig_atomic_t g_program = -1;  // the guardian's program, once started

void on_launcher_death(int) {
  g_launcher_died = 1;
  if (g_program > 0) {
    kill(static_cast<pid_t>(g_program), SIGKILL);  // the guardian then sweeps the rest
  } else {
    killpg(0, SIGKILL);
  }
}

// The guardian's end when the launcher died: every process below it, then its whole group.
[[noreturn]] void guardian_kill_everything() {
  proc::kill_descendants();
  killpg(0, SIGKILL);
  _exit(128 + SIGKILL);
}

int relay_exit_of(pid_t prog) {
  int status = 0;
  // Also reaps the orphans re-parented here as they end, so that none lingers as a zombie.
  for (pid_t pid; (pid = waitpid(-1, &status, 0)) != prog;) {
    if (pid < 0 && errno != EINTR) return 126;
  }
  if (g_launcher_died) guardian_kill_everything();
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    kill(getpid(), sig);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 126;
}

}  // namespace

// The guardian (Note [Guardian]), in the child of the launcher's fork: it leads the worker's own
// process group (teardown signals the group whole), dies with the launcher, starts the program
// and exits as it did. `pid_fd` tells the launcher the program's pid.
[[noreturn]] void run_guardian(pid_t launcher, int out_fd, int err_fd, int pid_fd, char** argv,
                               char** envp) {
  setpgid(0, 0);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  signal(SIGCHLD, SIG_DFL);
  signal(SIGINT, SIG_IGN);  // the group's SIGINT/SIGTERM are for the program
  signal(SIGTERM, SIG_IGN);
  struct sigaction sa {};
  sa.sa_handler = on_launcher_death;  // no SA_RESTART: it interrupts waitpid
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR2, &sa, nullptr);
  sigset_t usr2, none;
  sigemptyset(&usr2);
  sigaddset(&usr2, SIGUSR2);
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &usr2, nullptr);  // until g_program is known
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  prctl(PR_SET_PDEATHSIG, SIGUSR2);
  pid_t prog = fork();
  if (prog == 0) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGUSR2, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(argv[0], argv, envp);
    dprintf(STDERR_FILENO, "cannot execute '%s': %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  g_program = prog;
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (getppid() != launcher) on_launcher_death(SIGUSR2);
  // Tell the launcher which pid the program has: that is the one its summary names.
  [[maybe_unused]] auto n = write(pid_fd, &prog, sizeof(prog));
  close(pid_fd);
  _exit(prog < 0 ? 126 : relay_exit_of(prog));
}

}  // namespace scaletrain::launch_detail
