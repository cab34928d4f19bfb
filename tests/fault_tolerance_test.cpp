// Fault-tolerant replicas (fault_tolerance.h, Note [Replica groups]): a replica that joins late
// takes the donor's state and the two end equal, each sample of an epoch trained once. The job
// from the command line, under a kill loop and under attack: fault_tolerant_job_test.cpp.

#include "scaletrain/fault_tolerance.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "dist/lighthouse_client.h"
#include "scaletrain/blocks.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/trainer.h"
#include "support/lighthouse.h"
#include "support/net.h"
#include "support/ranks.h"
#include "support/secret.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

using testing::BareReplica;
using testing::cli_path;
using testing::run_command;
using testing::TempDir;
using testing::TestLighthouse;

using testing::net_model;
using testing::NetImpl;

// Replica 0 trains alone for a few steps; replica 1 starts then and asks with step 0: it takes
// replica 0's weights, momentum and data position (no file read), and from there the two step
// together on the average of their gradients. The samples are tagged by index (the target is
// the index, the loss learns index % 3): over both replicas each sample of each epoch is
// trained exactly once, and the replicas end with the same weights and momentum bit for bit.
class LateReplica : public ::testing::TestWithParam<Strategy> {};

TEST_P(LateReplica, TakesTheDonorsStateAndEachSampleIsTrainedOnce) {
  constexpr int64_t kSamples = 96;
  constexpr int kEpochs = 2;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  Dataset data;
  data.inputs = at::randn({kSamples, 6}, gen);
  data.targets = at::arange(kSamples, at::kLong);
  data.num_classes = 3;
  TempDir dir("ft_late_replica");
  TestLighthouse lighthouse;
  std::mutex mu;
  std::map<int64_t, int> seen;  // sample -> times trained
  std::atomic<int64_t> replica0_steps{0};
  std::atomic<bool> replica1_built{false};
  std::map<int, TrainResult> results;
  auto replica = [&](int id) {
    return testing::run_ranks(2, [&, id](Dist& d) {
      TrainTask task;
      task.train_data = in_memory(data);
      task.model = [&, id] {
        if (id == 1) replica1_built = true;
        return net_model(mu);
      };
      task.loss = [&](const at::Tensor& out, const at::Tensor& y) {
        {
          std::lock_guard<std::mutex> lock(mu);
          auto ys = y.cpu();
          for (int64_t i = 0; i < ys.numel(); ++i) ++seen[ys[i].item<int64_t>()];
        }
        return torch::nn::functional::cross_entropy(out, y.remainder(3));
      };
      task.optimizer = [](const std::vector<at::Tensor>& p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
      };
      task.on_step = [&, id](const StepReport& r) {
        if (id != 0) return;
        if (d.rank() == 0) replica0_steps = r.global_step;
        // Replica 0 waits at step 4 until replica 1 is being built, then goes on slowly enough
        // (40 more steps of 50 ms) that replica 1 joins well before the end.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (r.global_step == 4 && !replica1_built &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      };
      TrainerOptions o;
      o.strategy = GetParam();
      o.epochs = kEpochs;
      o.batch_size = 4;  // the replica's: 2 a rank
      o.out_dir = (dir.path / "run" / ("replica-" + std::to_string(id))).string();
      o.progress = false;
      o.tensorboard = false;
      o.log_every = 0;
      o.workers = 0;
      o.channels_last = false;
      o.device = at::kCPU;  // rank threads (regression RankThreadsSharedTheGpu, hardening_test)
      ReplicaGroupOptions ro;
      ro.secret = testing::kTestSecret;
      ro.lighthouse = "127.0.0.1:" + std::to_string(lighthouse.port);
      ro.replica_id = id;
      o.fault_tolerant = ro;
      auto r = train(task, o, d);
      std::lock_guard<std::mutex> lock(mu);
      if (d.rank() == 0) results[id] = r;
    });
  };
  std::vector<std::string> errors0, errors1;
  std::thread first([&] { errors0 = replica(0); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (replica0_steps < 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(replica0_steps.load(), 4) << "replica 0 did not reach step 4 within 60 s";
  std::thread second([&] { errors1 = replica(1); });
  first.join();
  second.join();
  for (const auto& e : errors0) ASSERT_EQ(e, "") << "replica 0";
  for (const auto& e : errors1) ASSERT_EQ(e, "") << "replica 1";
  {
    std::lock_guard<std::mutex> lock(lighthouse.mu);
    ASSERT_GE(lighthouse.quorums.size(), 2u);
    EXPECT_NE(lighthouse.quorums[1].find("1 (at step 0) takes the state of 0"), std::string::npos)
        << lighthouse.quorums[1];
  }
  // Every sample once an epoch, over both replicas.
  ASSERT_EQ(seen.size(), static_cast<size_t>(kSamples));
  for (const auto& [sample, count] : seen) EXPECT_EQ(count, kEpochs) << "sample " << sample;
  // The replicas end at the same step with the same weights and momentum, bit for bit: the
  // healed one took all of the donor's state, or the average would have pulled them apart.
  EXPECT_EQ(results[0].global_step, results[1].global_step);
  const std::string last = "ckpt-" + std::to_string(results[0].global_step);  // a DCP folder
  std::vector<std::vector<at::Tensor>> weights, momenta;
  for (int id : {0, 1}) {
    Model m = net_model(mu);
    auto params = m.module->parameters();
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto path = (dir.path / "run" / ("replica-" + std::to_string(id)) / last).string();
    // Every strategy's checkpoint holds an SGD over the model's parameters (ZeRO's gathered:
    // Note [ZeRO's optimizer in checkpoints]).
    auto s = load_checkpoint(path, *m.module, &opt, "net");
    EXPECT_EQ(s.sampler.epoch, kEpochs);
    EXPECT_TRUE(s.optimizer_restored) << "no optimizer state in " << path;
    std::vector<at::Tensor> w, mom;
    for (auto& p : params) {
      w.push_back(p.detach().clone());
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      ASSERT_NE(it, opt.state().end()) << path;
      mom.push_back(
          static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone());
    }
    weights.push_back(w);
    momenta.push_back(mom);
  }
  ASSERT_EQ(momenta[0].size(), momenta[1].size());
  for (size_t i = 0; i < weights[0].size(); ++i) {
    EXPECT_TRUE(at::equal(weights[0][i], weights[1][i])) << "parameter " << i;
  }
  for (size_t i = 0; i < momenta[0].size(); ++i) {
    EXPECT_TRUE(at::equal(momenta[0][i], momenta[1][i])) << "optimizer state " << i;
  }
}

// ddp within each replica, and the sharded strategies: rank k of a replica holds shard k of
// the optimizer's state, and its counterpart in the donor sends it exactly that shard.
INSTANTIATE_TEST_SUITE_P(Strategies, LateReplica,
                         ::testing::Values(Strategy::kDDP, Strategy::kZero1, Strategy::kZero2,
                                           Strategy::kFsdp),
                         [](const ::testing::TestParamInfo<Strategy>& p) {
                           return to_string(p.param);
                         });

// A lighthouse thread whose port is taken throws from its constructor, instead of a thread that
// died unseen and replicas that wait for it.
TEST(FaultTolerantReplicas, ALighthouseThreadOnATakenPortThrowsFromItsConstructor) {
  TestLighthouse first;
  LighthouseOptions o;
  o.host = "127.0.0.1";
  o.port = first.port;
  EXPECT_THROW(LighthouseThread second(o), Error);
  EXPECT_EQ(first.lighthouse.address(), "127.0.0.1:" + std::to_string(first.port));
}

TEST(FaultTolerantReplicas, BadOptionsAreRefusedWithTheFix) {
  EXPECT_THROW(parse_host_port("localhost", "--lighthouse"), UsageError);
  EXPECT_THROW(parse_host_port("h:0", "--lighthouse"), UsageError);
  EXPECT_THROW(parse_host_port("h:99999", "--lighthouse"), UsageError);
  EXPECT_EQ(parse_host_port("10.0.0.2:29510", "x"), std::make_pair(std::string("10.0.0.2"), 29510));
  LighthouseOptions o;
  o.min_replicas = 0;
  EXPECT_THROW(serve_lighthouse(o), UsageError);
  auto r = run_command(cli_path() + " train --fault-tolerant --out /tmp/x");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--fault-tolerant needs --lighthouse HOST:PORT"), std::string::npos)
      << r.output;
  r = run_command(cli_path() + " train --lighthouse 127.0.0.1:1 --out /tmp/x");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("add --fault-tolerant"), std::string::npos) << r.output;
  r = run_command("env -u SCALETRAIN_SECRET -u SCALETRAIN_SECRET_FILE " + cli_path() +
                  " train --fault-tolerant --lighthouse 127.0.0.1:1 --out /tmp/x");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("none was given: set SCALETRAIN_SECRET_FILE=PATH"), std::string::npos)
      << r.output;
  r = run_command(std::string("SCALETRAIN_SECRET=") + testing::kTestSecret + " " + cli_path() +
                  " train --fault-tolerant --lighthouse 127.0.0.1:1 --strategy grid --out /tmp/x");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--strategy ddp, zero1, zero2 or fsdp within each replica"),
            std::string::npos)
      << r.output;
}

// A member of the quorum that never makes the replicas' group (it died, or hangs, after the
// lighthouse answered) costs the others the exchange timeout (ReplicaGroupOptions::timeout), not
// the quorum's (minutes): the step is not committed, and the next quorum asks for a new group.
// The silent member is a bare client of the lighthouse that registers, beats and asks like
// replica 1, then never connects.
TEST(FaultTolerantReplicas, AMemberThatNeverConnectsCostsTheExchangeTimeoutAlone) {
  TestLighthouse lighthouse;
  const int port = lighthouse.port;
  std::atomic<bool> stop{false};
  BareReplica silent(port, 1, "silent");
  silent.ask_async(0, "|ranks=1");  // beats like a live replica, and never makes the group
  Quorum q;
  bool exchanged = true, committed = true;
  double seconds = 0;
  auto errors = testing::run_ranks(1, [&](Dist& d) {
    ReplicaGroupOptions ro;
    ro.secret = testing::kTestSecret;
    ro.lighthouse = "127.0.0.1:" + std::to_string(port);
    ro.replica_id = 0;
    ro.timeout = std::chrono::seconds(2);
    ro.quorum_timeout = std::chrono::seconds(120);
    ReplicaGroup group(d, ro);
    const auto start = std::chrono::steady_clock::now();
    q = group.quorum(0);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    auto t = at::ones({3});
    exchanged = group.all_reduce(t);
    committed = group.commit(true);
  });
  ASSERT_EQ(errors, std::vector<std::string>(1));
  EXPECT_EQ(q.replicas, (std::vector<int>{0, 1}));
  // The lighthouse's join timeout (1 s), then the connect's 2 s: far below the quorum's 120 s.
  EXPECT_LT(seconds, 20.0);
  EXPECT_FALSE(exchanged);
  EXPECT_FALSE(committed);
}

// Regression StalledHealHeldTheQuorum (the cause): a replica restarted while the lighthouse
// still counted its old process as a member asked without a new group, so the quorum kept its
// id. The healthy replica kept its group with the dead process, and the new process connected
// under the old group's keys, among the dead one's addresses: the heal failed or stalled, again
// at each quorum of the same members. A process's first request now asks for a new group.
TEST(FaultTolerantReplicas, AReplicaRestartedUnnoticedGetsAGroupWithTheHealthyOne) {
  TestLighthouse lighthouse;
  std::atomic<int> phase{0};  // 1: both exchanged once; 2: replica 1's new process exists
  auto options = [&](int id) {
    ReplicaGroupOptions ro;
    ro.secret = testing::kTestSecret;
    ro.lighthouse = "127.0.0.1:" + std::to_string(lighthouse.port);
    ro.replica_id = id;
    ro.timeout = std::chrono::seconds(3);
    ro.quorum_timeout = std::chrono::seconds(60);
    return ro;
  };
  auto wait_for = [&](int p) {
    for (int i = 0; i < 6000 && phase < p; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  std::vector<bool> healthy, restarted;  // share_state, then all_reduce, after the restart
  at::Tensor sum0, sum1, state;
  std::vector<std::string> errors0, errors1;
  std::thread zero([&] {
    errors0 = testing::run_ranks(1, [&](Dist& d) {
      ReplicaGroup g(d, options(0));
      g.quorum(0);
      auto t = at::ones({2});
      EXPECT_TRUE(g.all_reduce(t));
      EXPECT_TRUE(g.commit(true));
      ++phase;
      wait_for(3);  // replica 1 died and its new process asked
      const Quorum q = g.quorum(1);
      EXPECT_TRUE(q.heal);
      healthy.push_back(g.share_state([] { return at::full({4}, 7, at::kByte); }, nullptr));
      sum0 = at::ones({2});
      healthy.push_back(g.all_reduce(sum0));
    });
  });
  errors1 = testing::run_ranks(1, [&](Dist& d) {
    {
      ReplicaGroup g(d, options(1));
      g.quorum(0);
      auto t = at::ones({2});
      EXPECT_TRUE(g.all_reduce(t));
      EXPECT_TRUE(g.commit(true));
      ++phase;
      wait_for(2);
    }  // dies; a new process takes its place before the lighthouse misses its beats
    ReplicaGroup g(d, options(1));
    std::thread ask_then_mark([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ++phase;  // replica 0 asks now, after this one
    });
    const Quorum q = g.quorum(0);
    ask_then_mark.join();
    EXPECT_TRUE(q.recovering);
    restarted.push_back(g.share_state([] { return at::Tensor(); }, &state));
    sum1 = at::ones({2});
    restarted.push_back(g.all_reduce(sum1));
  });
  zero.join();
  ASSERT_EQ(errors0, std::vector<std::string>(1));
  ASSERT_EQ(errors1, std::vector<std::string>(1));
  EXPECT_EQ(healthy, (std::vector<bool>{true, true}));
  EXPECT_EQ(restarted, (std::vector<bool>{true, true}));
  ASSERT_TRUE(state.defined());
  EXPECT_TRUE(state.equal(at::full({4}, 7, at::kByte)));
  EXPECT_TRUE(sum0.equal(at::full({2}, 2.0f)));
  EXPECT_TRUE(sum1.equal(at::full({2}, 2.0f)));
}

}  // namespace
}  // namespace scaletrain
