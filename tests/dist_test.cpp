// Process-group bootstrap: rendezvous, run-id check, missing ranks, Gloo collectives.

#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <thread>

#include "scaletrain/dist.h"

#include <unistd.h>

#include "dist/heartbeat.h"
#include "dist/store_server.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"
#include "support/subprocess.h"

namespace scaletrain {
namespace {

using testing::cli_path;
using testing::run_command;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(Dist, AutoBackendIsNcclOnlyWithAGpuPerLocalProcess) {
  EXPECT_EQ(resolve_backend("auto", 0, 1), "gloo");
  EXPECT_EQ(resolve_backend("auto", 1, 1), "nccl");
  EXPECT_EQ(resolve_backend("auto", 1, 2), "gloo");  // two ranks would share the GPU
  EXPECT_EQ(resolve_backend("auto", 8, 8), "nccl");
  EXPECT_EQ(resolve_backend("auto", 8, 4), "nccl");
  EXPECT_EQ(resolve_backend("gloo", 8, 8), "gloo");
  EXPECT_EQ(resolve_backend("nccl", 1, 2), "nccl");  // asked for: NCCL's own error follows
}

TEST(Dist, SingleProcessGroupAllReduces) {
  InitOptions o;
  World w;
  w.master_port = testing::free_port();
  o.world = w;
  o.backend = "gloo";  // CPU tensors, on a machine with GPUs too
  Dist d = init_process_group(o);
  EXPECT_EQ(d.backend_name, "gloo");
  std::vector<at::Tensor> t{at::arange(4, at::kFloat)};
  d.backend->allreduce(t)->wait();
  EXPECT_TRUE(at::equal(t[0], at::arange(4, at::kFloat)));
}

class DistWorlds : public ::testing::TestWithParam<int> {};

TEST_P(DistWorlds, AllReduceAcrossProcessesStartedByTheLauncher) {
  const int n = GetParam();
  auto r = run_command(cli_path() + " run --nproc-per-node " + std::to_string(n) +
                       " --master-port 0 -- " + cli_path() + " check --numel 1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string want = std::to_string(n * (n + 1) / 2);
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_TRUE(contains(r.output, "[rank" + std::to_string(rank) + "]:rank " +
                                       std::to_string(rank) +
                                       ": gloo all-reduce of 1000 floats "
                                       "ok (expected " +
                                       want))
        << r.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, DistWorlds, ::testing::Values(2, 3));

TEST(Dist, ProcessOfAnotherRunIsRefused) {
  const std::string port = std::to_string(testing::free_port());
  const std::string base =
      "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " WORLD_SIZE=2 SCALETRAIN_RDZV_TIMEOUT=5 ";
  auto r = run_command("(" + base + "RANK=0 TORCHELASTIC_RUN_ID=alpha " + cli_path() +
                       " check > /dev/null 2>&1 &) ; sleep 0.5; " + base +
                       "RANK=1 TORCHELASTIC_RUN_ID=beta " + cli_path() + " check");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 of run 'beta' reached the store at 127.0.0.1:" + port +
                                     ", which serves run 'alpha'"))
      << r.output;
}

TEST(Dist, MissingRanksAreNamedAfterTheTimeout) {
  const std::string port = std::to_string(testing::free_port());
  auto r = run_command("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                       " WORLD_SIZE=3 RANK=0 SCALETRAIN_RDZV_TIMEOUT=1.5 " + cli_path() + " check");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(contains(r.output, "2 of 3 ranks never arrived (ranks 1, 2)")) << r.output;
}

TEST(Dist, UnknownBackendIsAUsageError) {
  InitOptions o;
  o.world = World{};
  o.backend = "mpi-over-carrier-pigeon";
  EXPECT_THROW(init_process_group(o), UsageError);
}

TEST(Dist, NcclWithoutGpuIsRefusedClearly) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  InitOptions o;
  World w;
  w.master_port = testing::free_port();
  o.world = w;
  o.backend = "nccl";
  try {
    init_process_group(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "nccl")) << e.what();
  }
}

}  // namespace
}  // namespace scaletrain

namespace scaletrain {
namespace {

TEST(Dist, SingleNodeStoreListensOnLoopbackOnly) {
  if (run_command("command -v ss").exit_code != 0) GTEST_SKIP() << "no `ss` (iproute2) here";
  // Rank 0 of a 2-rank world waits at rendezvous; meanwhile look at its listening socket.
  const std::string port = std::to_string(testing::free_port());
  auto r = run_command("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                       " RANK=0 WORLD_SIZE=2 SCALETRAIN_RDZV_TIMEOUT=8 " + cli_path() +
                       " check > /dev/null 2>&1 & for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.5; "
                       "ss -Hltn 'sport = :" +
                       port +
                       "' | grep -q . && break; done; "
                       "ss -Hltn 'sport = :" +
                       port + "'; kill $! 2>/dev/null; wait");
  EXPECT_TRUE(contains(r.output, "127.0.0.1:" + port)) << r.output;
  EXPECT_FALSE(contains(r.output, "0.0.0.0:" + port)) << r.output;
  EXPECT_FALSE(contains(r.output, "*:" + port)) << r.output;
}

}  // namespace
}  // namespace scaletrain

#include "support/ranks.h"

namespace scaletrain {
namespace {

// Dist's collectives (dist.h) over 1 to 4 ranks as threads, with every value checked: integers
// (floats holding small integers), so every sum is exact.
class DistCollectives : public ::testing::TestWithParam<int> {};

TEST_P(DistCollectives, EachCollectiveGivesItsResultOnEveryRank) {
  const int n = GetParam();
  auto errors = testing::run_ranks(n, [&](Dist& d) {
    const auto r = static_cast<float>(d.rank());
    auto t = at::full({3}, r + 1);
    d.all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({3}, n * (n + 1) / 2.0f)));
    auto m = at::full({2}, r);
    d.all_reduce(m, c10d::ReduceOp::MAX);
    EXPECT_TRUE(at::equal(m, at::full({2}, n - 1.0f)));

    auto b = at::full({4}, r);
    d.broadcast(b, n - 1);
    EXPECT_TRUE(at::equal(b, at::full({4}, n - 1.0f)));

    auto all = d.all_gather(at::full({2}, r * 10));
    ASSERT_EQ(all.size(), static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(all[i], at::full({2}, i * 10.0f)));

    auto flat = d.all_gather_into_tensor(at::full({2, 3}, r));
    ASSERT_EQ(flat.sizes(), (std::vector<int64_t>{2 * n, 3}));
    for (int i = 0; i < n; ++i)
      EXPECT_TRUE(at::equal(flat.narrow(0, 2 * i, 2), at::full({2, 3}, float(i))));

    // Rank r contributes r + slice index at every slice: slice s sums to n·s + n(n-1)/2.
    auto in = at::arange(n, at::kFloat).repeat_interleave(2) + r;  // [n·2]
    auto mine = d.reduce_scatter_tensor(in);
    ASSERT_EQ(mine.sizes(), (std::vector<int64_t>{2}));
    EXPECT_TRUE(at::equal(mine, at::full({2}, n * r + n * (n - 1) / 2.0f))) << mine;
    EXPECT_THROW(d.reduce_scatter_tensor(at::scalar_tensor(1.0)), UsageError);
    if (n > 1) {
      EXPECT_THROW(d.reduce_scatter_tensor(at::zeros({2 * n + 1})), UsageError);
    }
    EXPECT_THROW(d.broadcast(b, n), UsageError);
    d.barrier();
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(n)));
}

// all_to_all_single with uneven splits, as expert parallelism's dispatch sends them: rank r
// sends r + j + 1 rows to rank j, each row [100·r + j, its index among them]; rank j receives,
// in rank order, r + j + 1 rows from each rank r. Equal parts when no split is given. A rank
// that sends nothing to some rank, and bad splits.
TEST_P(DistCollectives, AllToAllSingleSendsEachRankItsRows) {
  const int n = GetParam();
  auto errors = testing::run_ranks(n, [&](Dist& d) {
    const int r = d.rank();
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> rows;
    for (int j = 0; j < n; ++j) {
      const int64_t k = (r == 0 && j == n - 1) ? 0 : r + j + 1;  // rank 0 sends none to the last
      in_splits.push_back(k);
      out_splits.push_back((j == 0 && r == n - 1) ? 0 : j + r + 1);
      rows.push_back(at::stack({at::full({k}, 100.0 * r + j), at::arange(k).to(at::kDouble)}, 1));
    }
    const at::Tensor got = d.all_to_all_single(at::cat(rows), out_splits, in_splits);
    int64_t at_row = 0;
    for (int src = 0; src < n; ++src) {
      const int64_t k = out_splits[static_cast<size_t>(src)];
      const at::Tensor want =
          at::stack({at::full({k}, 100.0 * src + r), at::arange(k).to(at::kDouble)}, 1);
      if (!at::equal(got.narrow(0, at_row, k), want)) {
        throw Error("rows from rank " + std::to_string(src) + " differ");
      }
      at_row += k;
    }
    if (at_row != got.size(0)) throw Error("extra rows");
    const at::Tensor equal = d.all_to_all_single(at::full({2 * n, 3}, double(r)));
    for (int src = 0; src < n; ++src) {
      if (!at::equal(equal.narrow(0, 2 * src, 2), at::full({2, 3}, double(src)))) {
        throw Error("equal parts from rank " + std::to_string(src) + " differ");
      }
    }
    EXPECT_THROW(d.all_to_all_single(at::zeros({3}), {}, {1, 1}), UsageError);
    if (n > 1) {
      EXPECT_THROW(d.all_to_all_single(at::zeros({2 * n + 1})), UsageError);
    }
    d.barrier();
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(n)));
}

INSTANTIATE_TEST_SUITE_P(Sizes, DistCollectives, ::testing::Values(1, 2, 3, 4));

// A rank that never joins a collective: the others fail within the group's timeout, with an error
// naming the collective and the rank.
// Regression (TwoTestsMetOnOnePort): ranks whose drawn port another test's store holds start
// again on another one instead of failing (tests/support/ranks.h). The first port given here is
// that of a store with another secret, as a test beside this one has; the ranks then meet on the
// next and sum.
TEST(DistCollectives, TestRanksStartAgainWhenTheirPortIsTaken) {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.secret = std::string(testing::kTestSecret) + "-another-test";
  so.log = [](const std::string&) {};
  StoreServer other(so);
  const int taken = other.port();
  int draws = 0;
  auto errors = testing::run_ranks(
      2,
      [&](Dist& d) {
        auto t = at::ones({1});
        d.all_reduce(t);
        EXPECT_EQ(t.item<float>(), 2.0f);
      },
      std::chrono::seconds(30), "gloo",
      [&] { return ++draws == 1 ? taken : testing::free_port(); });
  EXPECT_EQ(errors, std::vector<std::string>(2)) << "port " << taken;
  EXPECT_EQ(draws, 2);
}

TEST(DistCollectives, MissingRankFailsTheCollectiveNamingIt) {
  auto errors = testing::run_ranks(
      2,
      [&](Dist& d) {
        if (d.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(3));
          return;
        }
        auto t = at::ones({8});
        d.all_reduce(t);
      },
      std::chrono::milliseconds(500));
  EXPECT_NE(errors[0].find("rank 0 of 2: all_reduce of a [8] tensor timed out"), std::string::npos)
      << errors[0];
}

// The _async forms and point-to-point over 1 to 4 ranks: a Pending waits once, says done() after,
// and a default one is complete; the store is shared by the group.
TEST_P(DistCollectives, AsyncFormsAndPointToPointGiveTheSameResults) {
  const int n = GetParam();
  auto errors = testing::run_ranks(n, [&](Dist& d) {
    const auto r = static_cast<float>(d.rank());
    auto t = at::full({5}, r + 1);
    Pending sum = d.all_reduce_async(t, ReduceOp::SUM, "sum of t");
    EXPECT_TRUE(static_cast<bool>(sum));
    sum.wait();
    EXPECT_FALSE(static_cast<bool>(sum));
    EXPECT_TRUE(sum.done());
    sum.wait();  // a second wait returns at once
    EXPECT_TRUE(at::equal(t, at::full({5}, n * (n + 1) / 2.0f)));
    EXPECT_TRUE(Pending().done());

    auto flat = at::empty({3 * n});
    d.all_gather_into_tensor_async(flat, at::full({3}, r)).wait();
    for (int i = 0; i < n; ++i)
      EXPECT_TRUE(at::equal(flat.narrow(0, 3 * i, 3), at::full({3}, float(i))));

    auto in = at::arange(n, at::kFloat).repeat_interleave(2) + r;
    auto mine = at::empty({2});
    d.reduce_scatter_tensor_async(mine, in, ReduceOp::MAX).wait();
    EXPECT_TRUE(at::equal(mine, at::full({2}, d.rank() + n - 1.0f))) << mine;

    // A ring: each rank sends its rank to the next and receives the previous one's, once
    // in flight; then rank 0 to rank 1, blocking.
    if (n > 1) {
      const int next = (d.rank() + 1) % n, prev = (d.rank() + n - 1) % n;
      auto from = at::empty({2});
      Pending got = d.irecv(from, prev, 7);
      Pending sent = d.isend(at::full({2}, r), next, 7);
      got.wait();
      sent.wait();
      EXPECT_TRUE(at::equal(from, at::full({2}, static_cast<float>(prev))));
      auto x = at::full({1}, r * 2);
      if (d.rank() == 0) d.send(x, 1, 8, "x to rank 1");
      if (d.rank() == 1) {
        d.recv(x, 0, 8);
        EXPECT_EQ(x.item<float>(), 0.0f);
      }
      EXPECT_THROW(d.isend(x, n, 9), UsageError);
    }
    EXPECT_GE(d.store_add("async-test/count", 1), 1);
    d.barrier("after the count");
    EXPECT_EQ(d.store_add("async-test/count", 0), n);
    if (d.rank() == 0) d.store_set("async-test/word", "hello");
    EXPECT_EQ(d.store_get("async-test/word"), "hello");
    EXPECT_TRUE(d.store_check("async-test/word"));
    EXPECT_FALSE(d.store_check("async-test/no-such-key"));
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(n)));
}

// A Pending that never completes names its `what` in the timeout error.
TEST(DistCollectives, PendingTimeoutNamesWhatItWaitsFor) {
  auto errors = testing::run_ranks(
      2,
      [&](Dist& d) {
        if (d.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(3));
          return;
        }
        auto t = at::zeros({4});
        d.irecv(t, 1, 3, "the weights from rank 1").wait();
      },
      std::chrono::milliseconds(500));
  EXPECT_NE(errors[0].find("rank 0 of 2: the weights from rank 1 timed out"), std::string::npos)
      << errors[0];
}

// mesh_groups(): each rank's group along each dimension of a 2 x 3 mesh is a working process
// group of exactly the ranks the mesh names, ranked by their coordinate there.
TEST(MeshGroups, EachGroupReducesOverItsOwnRanksOnly) {
  const DeviceMesh mesh({{"dp", 2}, {"tp", 3}}, 6);
  std::vector<std::map<std::string, std::pair<int, double>>> seen(6);
  std::mutex mu;
  auto errors = testing::run_ranks(6, [&](Dist& d) {
    auto groups = mesh_groups(d, mesh, "test");
    for (const auto& [dim, g] : groups) {
      auto t = at::full({1}, static_cast<double>(d.rank()), at::kDouble);
      g.all_reduce(t);
      std::lock_guard<std::mutex> lock(mu);
      seen[static_cast<size_t>(d.rank())][dim] = {g.rank(), t.item<double>()};
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < 6; ++r) {
    for (const char* dim : {"dp", "tp"}) {
      double sum = 0;
      for (int member : mesh.group(r, dim)) sum += member;
      EXPECT_EQ(seen[static_cast<size_t>(r)][dim].second, sum) << "rank " << r << " " << dim;
      EXPECT_EQ(seen[static_cast<size_t>(r)][dim].first, mesh.coordinate(r, dim));
    }
  }
}

}  // namespace
}  // namespace scaletrain

namespace scaletrain {
namespace {

// A world of one on a free port, whose store carries the heartbeats' port; `w` is its world.
Dist store_of_one(World& w) {
  w.master_port = testing::free_port();
  InitOptions o;
  o.world = w;
  o.backend = "gloo";
  return init_process_group(o);
}

// Note [Heartbeats]: a rank that does not beat is named, a rank that beats (alive, wherever it
// waits) is not, and rank 0 not answering is reported instead of waited for.
TEST(Heartbeat, NamesTheRanksThatDoNotBeatOnly) {
  World w;
  Dist store = store_of_one(w);
  w.world_size = 3;
  const auto interval = std::chrono::milliseconds(100);
  World w1 = w, w2 = w;
  w1.rank = 1, w2.rank = 2;
  Heartbeat rank0(w, *store.store, interval);
  auto rank2 = std::make_unique<Heartbeat>(w2, *store.store, interval);
  std::this_thread::sleep_for(3 * interval);
  std::string silent = rank0.silent_ranks();
  EXPECT_NE(silent.find("rank 1: never beat"), std::string::npos) << silent;
  EXPECT_EQ(silent.find("rank 2"), std::string::npos) << silent;
  Heartbeat rank1(w1, *store.store, interval);
  std::this_thread::sleep_for(3 * interval);
  EXPECT_EQ(rank1.silent_ranks(), "");  // asked over the network: every rank beats
  rank2.reset();                        // its connection closes
  std::this_thread::sleep_for(3 * interval);
  for (const std::string& view : {rank0.silent_ranks(), rank1.silent_ranks()}) {
    EXPECT_NE(view.find("rank 2 (host "), std::string::npos) << view;
    EXPECT_NE(view.find("pid " + std::to_string(getpid()) + "): left"), std::string::npos) << view;
    EXPECT_EQ(view.find("rank 1"), std::string::npos) << view;
  }
}

TEST(Heartbeat, RankZeroThatDoesNotAnswerIsReported) {
  World w;
  Dist store = store_of_one(w);
  w.world_size = 2;
  World w1 = w;
  w1.rank = 1;
  auto rank0 = std::make_unique<Heartbeat>(w, *store.store, std::chrono::milliseconds(100));
  Heartbeat rank1(w1, *store.store, std::chrono::milliseconds(100));
  EXPECT_EQ(rank1.silent_ranks(), "");
  rank0.reset();
  const std::string silent = rank1.silent_ranks();
  EXPECT_NE(silent.find("not answering: rank 0"), std::string::npos) << silent;
}

}  // namespace
}  // namespace scaletrain
