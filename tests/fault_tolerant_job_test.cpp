// A fault-tolerant job from the command line (tests/scripts/ft_job.sh: a lighthouse and 2
// replicas x 2 ranks, each replica under its own launcher), under a kill loop (scripts/punisher),
// with workers stopped, and attacked by a process without the job's secret
// (tests/scripts/attacker.py). Each ends with its replicas equal, as accurate as a calm job,
// every checkpoint valid and no process left.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "scaletrain/checkpoint.h"
#include "support/attacks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::expect_every_attack_refused;
using testing::run_command;
using testing::script_path;
using testing::TempDir;

// The job's training flags, `epochs` epochs.
std::string job_flags(int epochs) {
  return " --device cpu --limit-train 8192 --limit-test 2000 --epochs " + std::to_string(epochs) +
         " --batch-size 64 --checkpoint-every 40 --keep 100 --no-progress --log-every 16 "
         "--timeout 5 --ft-timeout 3";
}

// tests/scripts/ft_job.sh: `signal` none, KILL, STOP or ATTACK.
testing::CommandResult ft_job(const fs::path& dir, const std::string& signal, int epochs = 6) {
  // (The punisher's overrides, for scripts/kill-loop-accuracy.sh, are not this test's.)
  return run_command("env -u PUNISH_EVERY -u PUNISH_FOR -u PUNISH_SEED " +
                         script_path("ft_job.sh") + " " + cli_path() + " " + dir.string() + " " +
                         std::to_string(testing::free_port()) + " " + signal + job_flags(epochs),
                     400);
}

// The test accuracy each replica's summary gave.
std::vector<double> accuracies(const std::string& output) {
  std::vector<double> out;
  std::regex re("test accuracy +([0-9.]+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re);
       it != std::sregex_iterator(); ++it) {
    out.push_back(std::stod((*it)[1]));
  }
  return out;
}

std::string file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// What every fault-tolerant job must leave: both replicas done, equal weights, every
// checkpoint valid, no process behind.
void expect_a_clean_end(const testing::CommandResult& r, const fs::path& dir) {
  EXPECT_NE(r.output.find("replica 0 exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("replica 1 exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lighthouse exit 0"), std::string::npos) << r.output;
  // Each replica that trained to the end holds the same weights. (One restarted after the other
  // had finished says so, and stops: it has no peer left to heal it.)
  std::vector<std::string> finals;
  for (const char* replica : {"replica-0", "replica-1"}) {
    if (fs::exists(dir / "run" / replica / "model.pt")) {
      finals.push_back(file(dir / "run" / replica / "model.pt"));
    }
  }
  const bool one_left_behind = r.output.find("nothing is left to train here") != std::string::npos;
  ASSERT_EQ(finals.size(), one_left_behind ? 1u : 2u) << r.output;
  if (finals.size() == 2) {
    EXPECT_EQ(finals[0], finals[1]) << "the replicas ended with other weights";
  }
  int checkpoints = 0;
  for (const char* replica : {"replica-0", "replica-1"}) {
    for (const auto& e : fs::directory_iterator(dir / "run" / replica)) {
      // A DCP folder ckpt-<step>/ (the default) or a file ckpt-<step>.st.
      static const std::regex kCheckpoint("ckpt-[0-9]+(\\.st)?");
      if (!std::regex_match(e.path().filename().string(), kCheckpoint)) continue;
      ++checkpoints;
      EXPECT_EQ(checkpoint_problem(e.path().string()), std::nullopt) << e.path();
      Model m = make_model("lenet");
      EXPECT_NO_THROW(load_checkpoint(e.path().string(), *m.module, nullptr, "lenet")) << e.path();
    }
  }
  EXPECT_GT(checkpoints, 4);
  // (The pattern's [n] keeps pgrep from finding the shell that runs it.)
  EXPECT_NE(run_command("pgrep -f -- '--out " + (dir / "ru[n]").string() + "'").exit_code, 0)
      << "a process of the job is left";
}

// SIGKILL to a random worker every 4 s for 16 s: the killed replica's launcher restarts it, the
// other goes on alone meanwhile, and the restarted one is healed from it.
TEST(FaultTolerantJob, KillLoopEndsWithEqualReplicasAsAccurateAsNoKill) {
  TempDir calm("ft_calm"), killed("ft_killed");
  auto base = ft_job(calm.path, "none");
  expect_a_clean_end(base, calm.path);
  auto r = ft_job(killed.path, "KILL");
  expect_a_clean_end(r, killed.path);
  EXPECT_NE(r.output.find("punisher: SIGKILL"), std::string::npos) << r.output;
  // The lighthouse saw a replica go: it left a quorum, or (regression
  // KillLoopLandedBeforeTheReplicaFirstJoined: on a loaded machine every kill may come while the
  // replica is still starting) it joined only after the other had trained alone.
  EXPECT_TRUE(
      std::regex_search(r.output, std::regex("lighthouse: .*: replica [01]; [01] left")) ||
      std::regex_search(r.output, std::regex("lighthouse: .*: quorum 2 at step [1-9][0-9]*: "
                                             "replicas 0, 1; [01] \\(at step [0-9]+\\) takes")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("[01] \\(at step [0-9]+\\) takes the state")))
      << r.output;
  const auto calm_acc = accuracies(base.output), killed_acc = accuracies(r.output);
  ASSERT_FALSE(calm_acc.empty()) << base.output;
  ASSERT_FALSE(killed_acc.empty()) << r.output;
  // Two runs over other batch sequences (the batch shrank while a replica was gone) differ by
  // the noise of SGD: on this small job (8192 images) killed and calm jobs ended up to 3.3
  // points apart on 2000 test images in five trials at 4 and 6 epochs. A lost epoch or a
  // diverged replica would show far beyond it. On the whole data set the killed runs' mean is
  // within 0.1 points of the calm runs' (scripts/kill-loop-accuracy.sh, docs/resilience.md).
  EXPECT_NEAR(killed_acc.back(), calm_acc.back(), 0.04) << r.output;
}

// SIGSTOP instead: the stopped worker's replica fails by its own timeout (--timeout 5) and is
// restarted; the other leaves it out once its exchange times out (--ft-timeout 3). A worker
// stopped while its replica starts holds that replica in the rendezvous (--rdzv-timeout 20, and
// c10d retries once): the other may then finish alone, and the late one, told so, stops. A
// stopped rank 0 holds its peer's store requests, which have no timeout: its launcher fails the
// group after --stopped-timeout 8 (regression StoppedStoreServerHeldItsPeersForever: this test
// once ran past 300 s, a replica's rank 1 waiting in DDP's constructor for its stopped rank 0).
TEST(FaultTolerantJob, StoppedWorkersAreLeftOutAndTheirReplicaComesBack) {
  TempDir stopped("ft_stopped");
  auto r = ft_job(stopped.path, "STOP");
  expect_a_clean_end(r, stopped.path);
  EXPECT_NE(r.output.find("punisher: SIGSTOP"), std::string::npos) << r.output;
  const bool healed =
      std::regex_search(r.output, std::regex("[01] \\(at step [0-9]+\\) takes the state"));
  const bool told = r.output.find("nothing is left to train here") != std::string::npos;
  EXPECT_TRUE(healed || told) << r.output;
}

// ---- Attacked from outside -------------------------------------------------------------------

// The first number after `label` in `output` ("job took 31.2 s" -> 31.2), or -1.
double number_after(const std::string& output, const std::string& label) {
  const auto at = output.find(label);
  return at == std::string::npos ? -1 : std::stod(output.substr(at + label.size()));
}

// Regressions AnyoneWhoReachedTheLighthouseJoinedAsAReplica, OneForgedDoneKeyStoppedEveryReplica,
// AFakeReplicaAtStepAMillionBecameTheDonor and AFloodOfConnectionsStalledTheLighthouse, end to
// end. An outside security pass, against the job before the control plane was authenticated:
// a process that reached the lighthouse joined as replica 7, read the job's settings, took the
// donor's state and injected gradients (accuracy 0.86 -> 0.107, both replicas exit 0); a forged
// ft/done ended every replica early without model.pt; a fake replica at step 10^6 became the
// donor and held the job at step 0; 4,000 connections took the job from 24 s to 430 s, and the
// lighthouse then ignored SIGTERM. The same attacks (tests/scripts/attacker.py: PyTorch's
// TCPStore protocol and scaletrain's frames, bare and after proofs from guessed secrets, a
// flood of 4,000 connections and slow ones) while the job trains: every one is refused, in the
// attacker's words and in the lighthouse's log; both replicas end with model.pt, the same
// weights as the calm job's wherever their quorums were the calm job's, and within its noise
// otherwise; the job takes less than six times the calm one's time, and the lighthouse stops
// on SIGTERM at once.
TEST(FaultTolerantJob, AttacksFromOutsideChangeNothing) {
  if (run_command("command -v python3").exit_code != 0) GTEST_SKIP() << "no python3 here";
  TempDir calm("ft_calm3"), attacked("ft_attacked");
  auto base = ft_job(calm.path, "none", 3);
  expect_a_clean_end(base, calm.path);
  auto r = ft_job(attacked.path, "ATTACK", 3);
  expect_a_clean_end(r, attacked.path);
  const std::string attacker = file(attacked.path / "attacker.log");
  const std::string lighthouse = file(attacked.path / "lighthouse.log");
  EXPECT_GE(expect_every_attack_refused(attacker, lighthouse), 40) << attacker;
  EXPECT_NE(attacker.find("model.pt files then: 0"), std::string::npos)
      << "the job ended before the attacks were all sent: they prove nothing\n"
      << r.output;
  // Only the job's replicas were ever in a quorum.
  const std::regex quorum("quorum [0-9]+ at step [0-9]+: replicas? ([0-9, ]+)");
  for (auto it = std::sregex_iterator(lighthouse.begin(), lighthouse.end(), quorum);
       it != std::sregex_iterator(); ++it) {
    EXPECT_TRUE(std::regex_match((*it)[1].str(), std::regex("[01](, [01])?"))) << lighthouse;
  }
  const fs::path model = fs::path("run") / "replica-0" / "model.pt";
  ASSERT_TRUE(fs::exists(attacked.path / "run" / "replica-1" / "model.pt")) << r.output;
  auto one_quorum = [](const std::string& log) {
    return std::regex_search(log, std::regex(": quorum 1 at")) &&
           !std::regex_search(log, std::regex(": quorum [2-9]"));
  };
  if (one_quorum(base.output) && one_quorum(r.output)) {  // the same steps: the same weights
    EXPECT_EQ(file(attacked.path / model), file(calm.path / model)) << r.output;
  }
  const auto calm_acc = accuracies(base.output), attacked_acc = accuracies(r.output);
  ASSERT_FALSE(calm_acc.empty()) << base.output;
  ASSERT_FALSE(attacked_acc.empty()) << r.output;
  EXPECT_NEAR(attacked_acc.back(), calm_acc.back(), 0.04) << r.output;  // as the kill loop's
  const double calm_s = number_after(base.output, "job took "),
               attacked_s = number_after(r.output, "job took ");
  EXPECT_GT(calm_s, 0) << base.output;
  EXPECT_GT(attacked_s, 0) << r.output;
  // The flood once took the job from 24 s to 430 s; the bound leaves room for the load other
  // tests put on the machine during one run and not the other.
  EXPECT_LT(attacked_s, 6 * calm_s) << r.output;
  const double stop_ms = number_after(r.output, "lighthouse stopped in ");
  EXPECT_GE(stop_ms, 0) << r.output;
  EXPECT_LT(stop_ms, 3000) << r.output;
}

}  // namespace
}  // namespace scaletrain
