// The lighthouse (fault_tolerance.h, Note [Replica groups]) against what it is told: processes
// without the job's secret, forged ends, claims ahead of the job, two processes with one replica
// id, replicas of other settings, and its own death. Regressions of the hardening pass that
// found each.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/fault_tolerance.h"
#include "scaletrain/trainer.h"
#include "support/lighthouse.h"
#include "support/net.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

using testing::BareReplica;
using testing::net_model;
using testing::replica_options;
using testing::TempDir;
using testing::TestLighthouse;

// A replica started with other settings would train something else beside the job (another
// seed: another permutation, some samples twice and others never; another learning rate or
// optimizer: weights apart, or a LibTorch assert hundreds of steps later): the lighthouse
// refuses it, its error names each setting that differs, and the job's replica goes on alone.
// Regressions AReplicaWithAnotherLearningRateTrainedBeside (accuracy 0.33/0.49, weights 10
// apart, both exit 0) and AReplicaWithAnotherOptimizerDiedInLibTorch.
struct OtherSettings {
  std::string name;
  uint64_t seed;
  OptimizerFactory optimizer;
  std::vector<std::string> named;  // in the refused replica's error
};

class ReplicaWithOtherSettings : public ::testing::TestWithParam<OtherSettings> {};

INSTANTIATE_TEST_SUITE_P(
    Settings, ReplicaWithOtherSettings,
    ::testing::Values(
        OtherSettings{"Seed", 7, nullptr, {"seed 7 here, 0 in the job"}},
        OtherSettings{"LearningRate",
                      0,
                      [](const std::vector<at::Tensor>& p) {
                        return std::make_unique<torch::optim::SGD>(
                            p, torch::optim::SGDOptions(0.5).momentum(0.9));
                      },
                      {"optimizer sgd(lr=0.5,momentum=0.9,", "here, sgd(lr=0.05,momentum=0.9,"}},
        OtherSettings{"Optimizer",
                      0,
                      [](const std::vector<at::Tensor>& p) {
                        return std::make_unique<torch::optim::Adam>(
                            p, torch::optim::AdamOptions(0.05));
                      },
                      {"optimizer adam(lr=0.05,betas=0.9/0.999,", "here, sgd(lr=0.05,"}}),
    [](const ::testing::TestParamInfo<OtherSettings>& p) { return p.param.name; });

TEST_P(ReplicaWithOtherSettings, IsRefusedNamingWhatDiffers) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  Dataset data;
  data.inputs = at::randn({64, 6}, gen);
  data.targets = at::randint(3, {64}, gen);
  data.num_classes = 3;
  TempDir dir("ft_other_settings");
  TestLighthouse lighthouse;
  std::mutex mu;
  std::atomic<bool> started{false}, refused{false};
  auto replica = [&](int id, uint64_t seed, OptimizerFactory optimizer) {
    return testing::run_ranks(1, [&, id, seed, optimizer](Dist& d) {
      TrainTask task;
      task.train_data = in_memory(data);
      task.model = [&] { return net_model(mu); };
      if (optimizer) task.optimizer = optimizer;
      task.on_step = [&](const StepReport&) {
        started = true;
        for (int i = 0; i < 400 && !refused; ++i) {  // until the other one is refused
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      };
      TrainerOptions o;
      o.epochs = 1;
      o.batch_size = 8;
      o.seed = seed;
      o.out_dir = (dir.path / ("replica-" + std::to_string(id))).string();
      o.progress = false;
      o.tensorboard = false;
      o.log_every = 0;
      o.workers = 0;
      ReplicaGroupOptions ro;
      ro.secret = testing::kTestSecret;
      ro.lighthouse = "127.0.0.1:" + std::to_string(lighthouse.port);
      ro.replica_id = id;
      o.fault_tolerant = ro;
      try {
        train(task, o, d);
      } catch (const UsageError&) {
        refused = true;
        throw;
      }
    });
  };
  std::vector<std::string> errors0, errors1;
  std::thread first([&] { errors0 = replica(0, 0, nullptr); });
  for (int i = 0; i < 12000 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  errors1 = replica(1, GetParam().seed, GetParam().optimizer);
  first.join();
  ASSERT_EQ(errors0.size(), 1u);
  EXPECT_EQ(errors0[0], "");
  ASSERT_EQ(errors1.size(), 1u);
  EXPECT_NE(errors1[0].find("replica 1: its settings differ from the job's ("), std::string::npos)
      << errors1[0];
  for (const auto& what : GetParam().named) {
    EXPECT_NE(errors1[0].find(what), std::string::npos) << what << "\n" << errors1[0];
  }
}

// Regression AnyoneWhoReachedTheLighthouseJoinedAsAReplica: a process that could reach the
// lighthouse joined as replica 7, read the job's settings, received the donor's state and
// injected gradients (test accuracy 0.86 -> 0.107, both replicas exit 0). Without the job's
// secret a connection is refused before anything it says is read: no registration of it lands,
// and the job's quorums hold its own replicas alone.
TEST(FaultTolerantReplicas, AStrangerWithoutTheSecretCannotJoin) {
  TestLighthouse lighthouse;
  try {
    lighthouse_client("127.0.0.1", lighthouse.port, "a-guess-at-the-secret-0123",
                      std::chrono::seconds(5));
    ADD_FAILURE() << "a stranger connected";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "the lighthouse at 127.0.0.1:" + std::to_string(lighthouse.port) +
                  " refused this process: wrong secret"),
              std::string::npos)
        << e.what();
  }
  auto stranger = ReplicaGroupOptions(replica_options(lighthouse.port, 7));
  stranger.secret = "a-guess-at-the-secret-0123";
  auto errors7 = testing::run_ranks(1, [&](Dist& d) { ReplicaGroup g(d, stranger); });
  EXPECT_NE(errors7[0].find("replica 7: the lighthouse at"), std::string::npos) << errors7[0];
  Quorum q;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroup g(d, replica_options(lighthouse.port, 0));
    q = g.quorum(0);
  });
  ASSERT_EQ(errors, std::vector<std::string>(1));
  EXPECT_EQ(q.replicas, std::vector<int>{0});
  std::lock_guard<std::mutex> lock(lighthouse.mu);
  for (const auto& line : lighthouse.quorums) EXPECT_EQ(line.find('7'), std::string::npos) << line;
}

// Regressions OneForgedDoneKeyStoppedEveryReplica and AFakeReplicaAtStepAMillionBecameTheDonor,
// for what holds even inside the secret (a stale process, a bug): only the process that holds
// a member's id of the last quorum ends the run, at a step the job reached; a process asking
// with a step past the job's is refused instead of becoming the donor.
TEST(FaultTolerantReplicas, AForgedEndOrAStepAheadOfTheJobChangesNothing) {
  TestLighthouse lighthouse;
  std::vector<Quorum> quorums;
  std::string ahead;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroup g(d, replica_options(lighthouse.port, 0));
    quorums.push_back(g.quorum(0));  // alone, after the join timeout
    g.commit(true);
    BareReplica forger(lighthouse.port, 9, "forger");
    forger.store->set("ft/done/0/forged", BareReplica::bytes("1000000"));
    forger.store->set("ft/done/9/forger", BareReplica::bytes("1000000"));
    BareReplica donor(lighthouse.port, 5, "donor");
    donor.ask_async(1000000, "|ranks=1");
    ahead = donor.answer.get();
    for (int64_t step = 1; step <= 3; ++step) {
      quorums.push_back(g.quorum(step));
      g.commit(true);
    }
  });
  ASSERT_EQ(errors, std::vector<std::string>(1));
  EXPECT_EQ(ahead, "refused-step 0");
  ASSERT_EQ(quorums.size(), 4u);
  for (const auto& q : quorums) {
    EXPECT_EQ(q.finished_at, -1) << "the forged end was believed";
    EXPECT_EQ(q.replicas, std::vector<int>{0});
    EXPECT_FALSE(q.heal) << "the process ahead became a donor";
  }
}

// Regression AMalformedBeatStoppedTheLighthouse: a beat whose value is no number (one `set` by a
// process that holds the secret: a bug, an older tool) threw out of the lighthouse's loop
// ("scaletrain: error: stoll", exit 1), and every replica's next quorum failed with it. A beat
// is any change of its key's value now: the lighthouse goes on forming quorums.
TEST(FaultTolerantReplicas, AMalformedBeatLeavesTheLighthouseServing) {
  TestLighthouse lighthouse;
  auto store = lighthouse_client("127.0.0.1", lighthouse.port, testing::kTestSecret,
                                 std::chrono::seconds(5));
  store->set("ft/reg/3/bad", BareReplica::bytes("bad pid 1"));
  store->set("ft/beat/3/bad", BareReplica::bytes("not a number"));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the lighthouse reads them
  auto options = replica_options(lighthouse.port, 0);
  options.quorum_timeout = std::chrono::seconds(5);
  Quorum q;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroup g(d, options);
    q = g.quorum(0);
  });
  ASSERT_EQ(errors, std::vector<std::string>(1));
  EXPECT_EQ(q.replicas, std::vector<int>{0});
}

// Regression TwoProcessesWithOneReplicaIdTrainedApart: two replicas started with the same
// --replica-id: one trained alone at half the batch, the other waited, restarted, was told the
// others finished and exited 0 with no weights. The second live process is refused by name.
TEST(FaultTolerantReplicas, ASecondLiveProcessWithTheSameReplicaIdIsRefusedByName) {
  TestLighthouse lighthouse;
  std::atomic<bool> first_in{false}, second_done{false};
  std::vector<std::string> errors_first;
  std::thread first([&] {
    errors_first = testing::run_ranks(1, [&](Dist& d) {
      ReplicaGroup g(d, replica_options(lighthouse.port, 0));
      g.quorum(0);
      first_in = true;
      for (int i = 0; i < 3000 && !second_done; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  });
  for (int i = 0; i < 3000 && !first_in; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto start = std::chrono::steady_clock::now();
  auto errors_second = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroup g(d, replica_options(lighthouse.port, 0));
    g.quorum(0);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  second_done = true;
  first.join();
  EXPECT_EQ(errors_first, std::vector<std::string>(1));
  EXPECT_NE(errors_second[0].find("replica 0: another live process already trains as replica 0 ("),
            std::string::npos)
      << errors_second[0];
  EXPECT_NE(errors_second[0].find("give each replica its own ReplicaGroupOptions::replica_id"),
            std::string::npos)
      << errors_second[0];
  EXPECT_LT(seconds, 15.0) << "twice the heartbeat timeout, not the quorum's";
}

// Regression LighthouseDeathWas113FramesOfBacktrace: the lighthouse's death reached the
// replicas as "Failed to recv, got 0 bytes" with a c10d backtrace, and an unreachable one after
// 16 s. Both are one line naming the lighthouse and its address, within the timeouts.
TEST(FaultTolerantReplicas, ALighthouseGoneOrUnreachableIsNamedInOneLine) {
  auto lighthouse = std::make_unique<TestLighthouse>();
  const int port = lighthouse->port;
  std::string gone;
  double seconds = 0;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroup g(d, replica_options(port, 0));
    g.quorum(0);
    g.commit(true);
    lighthouse.reset();
    const auto start = std::chrono::steady_clock::now();
    try {
      g.quorum(1);
    } catch (const Error& e) {
      gone = e.what();
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  ASSERT_EQ(errors, std::vector<std::string>(1));
  const std::string address = "the lighthouse at 127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(gone.rfind("replica 0: " + address, 0), 0u) << gone;
  EXPECT_EQ(gone.find('\n'), std::string::npos) << gone;
  EXPECT_LT(seconds, 5.0);
  auto options = replica_options(testing::free_port(), 0);
  options.timeout = std::chrono::seconds(1);
  const auto start = std::chrono::steady_clock::now();
  auto unreachable = testing::run_ranks(1, [&](Dist& d) { ReplicaGroup g(d, options); });
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(unreachable[0].find("replica 0: the lighthouse at " + options.lighthouse +
                                " cannot be reached within 1 s (nothing listens there): start "
                                "it first"),
            std::string::npos)
      << unreachable[0];
  EXPECT_EQ(unreachable[0].find('\n'), std::string::npos) << unreachable[0];
  EXPECT_LT(seconds, 5.0);
}

}  // namespace
}  // namespace scaletrain
