// The elastic launchers' rendezvous (src/launch/rendezvous.h, Note [Elastic rendezvous]): a
// server and its clients in one process, on loopback. The launcher around it is tested from the
// command line in multinode_test.cpp (MultiNode.ElasticJob...).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "launch/auth.h"
#include "launch/net.h"
#include "launch/rendezvous.h"
#include "scaletrain/error.h"
#include "support/secret.h"
#include "support/subprocess.h"

namespace scaletrain::launch_detail {
namespace {

using Clock = std::chrono::steady_clock;

RendezvousOptions options(int min_nodes, int max_nodes) {
  RendezvousOptions o;
  o.port = testing::free_port();
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.last_call_s = 0.3;
  o.node_timeout_s = 3;
  o.join_timeout_s = 10;
  o.secret = testing::kTestSecret;
  return o;
}

// A raw connection to the rendezvous that proved the test's secret.
int proved_connection(const RendezvousOptions& o) {
  const int fd = net::connect_to("127.0.0.1", o.port, 1000);
  if (fd < 0) return -1;
  if (!net::prove(fd, o.secret, "rendezvous", 3000).empty()) {
    close(fd);
    return -1;
  }
  return fd;
}

// The server's side of the handshake on an accepted connection: true when it proved `secret`.
bool answer_handshake(int fd, const std::string& secret) {
  net::Gate gate(secret, "rendezvous");
  if (!net::send_all(fd, gate.hello())) return false;
  std::string buf, reply;
  const auto end = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 100);
    if (!net::read_available(fd, buf)) return false;
    const auto v = gate.take(buf, &reply);
    if (v == net::Gate::Verdict::kWaiting) continue;
    return net::send_all(fd, reply) && v == net::Gate::Verdict::kPassed;
  }
  return false;
}

// Waits up to `seconds` for the client's round to end.
bool recalled_within(RendezvousClient& c, double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    if (c.recalled()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(Rendezvous, FormsOnceMinHaveJoinedAndAgainWhenANodeLeavesOrJoins) {
  const auto o = options(1, 2);
  auto server = RendezvousServer::try_host(o);
  ASSERT_TRUE(server);
  EXPECT_FALSE(RendezvousServer::try_host(o)) << "a second host on a taken address";
  RendezvousClient host(o, /*hosting=*/true);
  auto b = std::make_unique<RendezvousClient>(o);
  auto joined_b = std::async(std::launch::async, [&] { return b->join(2, 4002); });
  const Round r1 = host.join(2, 4001);
  const Round r1b = joined_b.get();
  ASSERT_EQ(r1.kind, Round::kFormed);
  EXPECT_EQ(r1.nnodes, 2);
  EXPECT_EQ(r1.node_rank, 0) << "the host's node is node 0";
  EXPECT_EQ(r1b.node_rank, 1);
  EXPECT_EQ(r1b.master_port, 4001) << "node 0's port is the workers' store";
  EXPECT_EQ(r1b.master_addr, "127.0.0.1");

  b.reset();  // node b's launcher ends: its connection closes
  ASSERT_TRUE(recalled_within(host, 3));
  EXPECT_NE(host.take_recall().find("left: its connection closed"), std::string::npos);
  const Round r2 = host.join(2, 4003);
  EXPECT_EQ(r2.nnodes, 1);
  EXPECT_EQ(r2.round, r1.round + 1);

  RendezvousClient c(o);
  auto joined_c = std::async(std::launch::async, [&] { return c.join(2, 4004); });
  ASSERT_TRUE(recalled_within(host, 3)) << "a node joining while there is room ends the round";
  EXPECT_NE(host.take_recall().find("joined"), std::string::npos);
  const Round r3 = host.join(2, 4005);
  EXPECT_EQ(r3.nnodes, 2);
  EXPECT_EQ(joined_c.get().node_rank, 1);
  EXPECT_EQ(r3.restarts, 0) << "leaves and joins are not restarts";
  EXPECT_EQ(server->rounds_formed(), 3);
}

TEST(Rendezvous, NoRoundWhileAMemberOfTheLastOneIsStillStopping) {
  auto o = options(1, 2);
  o.max_restarts = 1;
  auto server = RendezvousServer::try_host(o);
  RendezvousClient host(o, true), b(o);
  auto joined_b = std::async(std::launch::async, [&] { return b.join(1, 4002); });
  host.join(1, 4001);
  joined_b.get();
  host.report_failed();  // host's workers failed: b is told to restart
  ASSERT_TRUE(recalled_within(b, 3));
  auto rejoined = std::async(std::launch::async, [&] { return host.join(1, 4003); });
  // b is still stopping its workers: the host alone (min 1) must not form a round without it.
  EXPECT_EQ(rejoined.wait_for(std::chrono::seconds(2)), std::future_status::timeout);
  b.take_recall();
  const Round rb = b.join(1, 4004);
  EXPECT_EQ(rb.nnodes, 2);
  EXPECT_EQ(rejoined.get().nnodes, 2);
  EXPECT_EQ(rb.restarts, 1) << "a failure is a restart";
}

TEST(Rendezvous, FailuresPastMaxRestartsAbortTheJobButOneRightAfterALeaveDoesNotCount) {
  auto o = options(1, 3);
  o.max_restarts = 0;
  auto server = RendezvousServer::try_host(o);
  RendezvousClient host(o, true);
  auto b = std::make_unique<RendezvousClient>(o);
  auto joined_b = std::async(std::launch::async, [&] { return b->join(1, 4002); });
  host.join(1, 4001);
  joined_b.get();
  b.reset();
  host.report_failed();  // its workers failed because b's did: the leave's consequence
  const Round again = host.join(1, 4003);
  ASSERT_EQ(again.kind, Round::kFormed) << again.reason;
  EXPECT_EQ(again.restarts, 0);

  // More than a second after the leave: a failure of its own, past --max-restarts 0.
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  host.report_failed();
  const Round aborted = host.join(1, 4004);
  ASSERT_EQ(aborted.kind, Round::kAborted);
  EXPECT_NE(aborted.reason.find("failed 1 time(s), more than --max-restarts 0"), std::string::npos)
      << aborted.reason;
}

// The host's worker count is the job's, whoever joins first (a node with another count never
// makes the host the one refused).
TEST(Rendezvous, ANodeWithAnotherWorkerCountOrRunIdIsRefusedWithTheFix) {
  auto o = options(2, 2);
  o.nproc = 2;
  auto server = RendezvousServer::try_host(o);
  RendezvousClient b(o);
  try {
    b.join(1, 4002);
    ADD_FAILURE() << "a node with 1 worker joined a job of 2 per node";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--nproc-per-node 1 and the rendezvous host has 2"),
              std::string::npos)
        << e.what();
  }
  RendezvousClient host(o, true);
  auto waiting = std::async(std::launch::async, [&] { return host.join(2, 4001); });
  auto other = o;
  other.run_id = "other";
  RendezvousClient c(other);
  EXPECT_THROW(c.join(2, 4003), UsageError);
  RendezvousClient d(o);
  EXPECT_EQ(d.join(2, 4004).nnodes, 2) << "the refusals left the rendezvous working";
  EXPECT_EQ(waiting.get().nnodes, 2);
}

// A node arriving when the world is full waits as a spare, and says so if nothing frees a place.
TEST(Rendezvous, ANodePastTheMostWaitsAsASpare) {
  auto o = options(1, 1);
  o.join_timeout_s = 1;
  auto server = RendezvousServer::try_host(o);
  RendezvousClient host(o, true);
  EXPECT_EQ(host.join(1, 4001).nnodes, 1);
  RendezvousClient spare(o);
  try {
    spare.join(1, 4002);
    ADD_FAILURE() << "a second node joined a world of at most 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("as a spare: the world is full (1 nodes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(host.recalled()) << "a spare does not end a full world's round";
}

TEST(Rendezvous, AJoinTimesOutNamingHowManyNodesWereThere) {
  auto o = options(2, 3);
  o.join_timeout_s = 1;
  auto server = RendezvousServer::try_host(o);
  RendezvousClient host(o, true);
  const auto start = Clock::now();
  try {
    host.join(1, 4001);
    ADD_FAILURE() << "a round formed with 1 of at least 2 nodes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 node(s) there, --nnodes asks for at least 2"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5);
}

TEST(Rendezvous, ALostHostIsARecallThatSaysSo) {
  const auto o = options(1, 1);
  auto server = RendezvousServer::try_host(o);
  RendezvousClient b(o);
  EXPECT_EQ(b.join(1, 4001).nnodes, 1);
  server.reset();
  ASSERT_TRUE(recalled_within(b, 3));
  EXPECT_NE(b.take_recall().find("closed the connection (its launcher ended)"), std::string::npos);
}

// Note [Cut-off node]: a node the host hears nothing from is dropped with a word it may still
// hear (a link down one way, or back just after): the host sends DROPPED before it closes.
TEST(Rendezvous, ASilentNodeIsToldItWasDropped) {
  auto o = options(1, 2);
  o.node_timeout_s = 1;
  auto server = RendezvousServer::try_host(o);
  ASSERT_TRUE(server);
  const int fd = proved_connection(o);  // a node that never beats
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(net::send_all(fd, "JOIN " + o.run_id + " 2 4001 silent:1 0\n"));
  std::string buf, dropped;
  const auto end = Clock::now() + std::chrono::seconds(5);
  while (dropped.empty() && Clock::now() < end) {
    const bool open = net::read_available(fd, buf);
    for (const auto& line : net::take_lines(buf)) {
      if (line.rfind("DROPPED ", 0) == 0) dropped = line;
    }
    if (!open) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  close(fd);
  EXPECT_NE(dropped.find("DROPPED no word from it for"), std::string::npos) << dropped;
}

// The node's side: told it was dropped, its round ends as a cut-off (it will connect again),
// not as a host that ended.
TEST(Rendezvous, ANodeToldItWasDroppedIsCutOff) {
  auto o = options(1, 1);
  const int listener = net::listen_on("127.0.0.1", o.port);
  ASSERT_GE(listener, 0);
  auto host = std::async(std::launch::async, [&] {
    pollfd p{listener, POLLIN, 0};
    if (poll(&p, 1, 5000) != 1) return;
    const int fd = accept(listener, nullptr, nullptr);
    if (!answer_handshake(fd, o.secret)) return;
    net::send_all(fd, "DROPPED no word from it for 4.0 s\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    close(fd);
  });
  RendezvousClient b(o);
  ASSERT_TRUE(recalled_within(b, 3));
  EXPECT_TRUE(b.cut_off());
  EXPECT_NE(b.take_recall("LOST").find("dropped this node: no word from it for 4.0 s"),
            std::string::npos);
  host.get();
  close(listener);
}

// Regression DoneFromAnyoneStoppedTheElasticJob: a stranger's `DONE` made the host stop
// forming rounds (a node that then died took the job down), and a phantom `JOIN` formed a world
// with a node that did not exist. Nothing a connection says before it proves the job's secret
// is read: the round still forms, of the real nodes alone.
TEST(Rendezvous, AStrangersDoneAndJoinAreNeverRead) {
  const auto o = options(2, 3);
  auto server = RendezvousServer::try_host(o);
  ASSERT_TRUE(server);
  const int stranger = net::connect_to("127.0.0.1", o.port, 1000);
  ASSERT_GE(stranger, 0);
  net::send_all(stranger, "DONE\nJOIN " + o.run_id + " 2 4009 phantom:1 0\n");
  RendezvousClient host(o, /*hosting=*/true);
  auto b = std::make_unique<RendezvousClient>(o);
  auto joined_b = std::async(std::launch::async, [&] { return b->join(2, 4002); });
  const Round r = host.join(2, 4001);
  joined_b.get();
  EXPECT_EQ(r.kind, Round::kFormed) << r.reason;
  EXPECT_EQ(r.nnodes, 2) << "no phantom node";
  char c;
  EXPECT_LE(recv(stranger, &c, 1, MSG_PEEK), 1);  // the challenge, then closed
  close(stranger);
}

// Only a node of the running round may end the job: a launcher of the job that is not in it (a
// spare, or one that joined late) saying DONE is ignored.
TEST(Rendezvous, ADoneFromANodeOutsideTheRoundIsIgnored) {
  const auto o = options(1, 1);
  auto server = RendezvousServer::try_host(o);
  ASSERT_TRUE(server);
  RendezvousClient host(o, /*hosting=*/true);
  ASSERT_EQ(host.join(2, 4001).kind, Round::kFormed);
  const int outsider = proved_connection(o);
  ASSERT_GE(outsider, 0);
  net::send_all(outsider, "DONE\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_FALSE(host.recalled());
  EXPECT_EQ(server->rounds_formed(), 1);
  close(outsider);
  // The job is not closed: the member's own failure still restarts it.
  host.report_failed();
  EXPECT_TRUE(recalled_within(host, 3));
  EXPECT_EQ(host.take_recall().rfind("RESTART", 0), 0u);
}

TEST(Rendezvous, ANodeWithAnotherSecretIsRefusedWithTheFix) {
  const auto o = options(1, 2);
  auto server = RendezvousServer::try_host(o);
  ASSERT_TRUE(server);
  auto other = o;
  other.secret = "another-secret-0123456789";
  try {
    RendezvousClient b(other);
    ADD_FAILURE() << "joined with another secret";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("refused this process: wrong secret: every node of a "
                                         "job needs the same secret"),
              std::string::npos)
        << e.what();
  }
}

TEST(Rendezvous, NoServerToReachFailsNamingTheAddress) {
  auto o = options(1, 1);
  o.join_timeout_s = 0.5;
  try {
    RendezvousClient b(o);
    ADD_FAILURE() << "connected to nothing";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the rendezvous at 127.0.0.1:"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace scaletrain::launch_detail
