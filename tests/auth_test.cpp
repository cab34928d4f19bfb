// The authenticated control plane (Note [Authenticated connections] in src/launch/auth.cpp, Note
// [Store protocol] in src/dist/store_server.cpp): the handshake, the store's door, the limits on
// strangers, and the interface a server listens on. LibTorch-free: a raw client speaks the
// store's frames here; AuthStore, its real client, is tested in auth_store_test.cpp.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "dist/store_server.h"
#include "dist/store_wire.h"
#include "launch/auth.h"
#include "launch/net.h"
#include "scaletrain/error.h"
#include "scaletrain/secret.h"
#include "support/secret.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Both ends of a connection on loopback: a listener, a client, and the accepted server side.
struct Pair {
  int client = -1, server = -1;
  Pair() {
    const int listener = net::listen_on("127.0.0.1", 0);
    client = net::connect_to("127.0.0.1", net::bound_port(listener), 1000);
    server = accept(listener, nullptr, nullptr);
    close(listener);
  }
  ~Pair() {
    close(client);
    close(server);
  }
};

// The server's side of one handshake with `secret` for `service`; its verdict.
std::future<net::Gate::Verdict> serve_one(int fd, const std::string& secret,
                                          const std::string& service) {
  return std::async(std::launch::async, [fd, secret, service] {
    net::Gate gate(secret, service);
    net::send_all(fd, gate.hello());
    std::string buf, reply;
    for (int i = 0; i < 300; ++i) {
      pollfd p{fd, POLLIN, 0};
      poll(&p, 1, 10);
      if (!net::read_available(fd, buf)) break;
      const auto v = gate.take(buf, &reply);
      if (v == net::Gate::Verdict::kWaiting) continue;
      net::send_all(fd, reply);
      return v;
    }
    return net::Gate::Verdict::kWaiting;
  });
}

TEST(Auth, BothSidesHoldingTheSecretPass) {
  Pair c;
  auto server = serve_one(c.server, testing::kTestSecret, "store");
  EXPECT_EQ(net::prove(c.client, testing::kTestSecret, "store", 3000), "");
  EXPECT_EQ(server.get(), net::Gate::Verdict::kPassed);
}

TEST(Auth, AWrongSecretIsRefusedAndSaysSo) {
  Pair c;
  auto server = serve_one(c.server, testing::kTestSecret, "store");
  const std::string why = net::prove(c.client, "another-secret-0123456789", "store", 3000);
  EXPECT_EQ(why, "refused this process: wrong secret");
  EXPECT_TRUE(net::is_wrong_secret(why));
  EXPECT_EQ(server.get(), net::Gate::Verdict::kRefused);
}

// A process that took the job's port cannot pose as its server: it cannot make the proof.
TEST(Auth, AServerWithoutTheSecretIsNotBelieved) {
  Pair c;
  auto fake = std::async(std::launch::async, [fd = c.server] {
    net::send_all(fd, "SCALETRAIN-AUTH 1 store " + std::string(64, 'a') + "\n");
    std::string buf;
    for (int i = 0; i < 300 && buf.find('\n') == std::string::npos; ++i) {
      net::read_available(fd, buf);
      std::this_thread::sleep_for(milliseconds(10));
    }
    net::send_all(fd, "OK " + std::string(64, 'b') + "\n");  // any proof: it has none
  });
  const std::string why = net::prove(c.client, testing::kTestSecret, "store", 3000);
  fake.get();
  EXPECT_EQ(why, "does not hold this job's secret (another job's server on the port?)");
}

TEST(Auth, AProofForOneServiceOpensNoOther) {
  Pair c;
  auto server = serve_one(c.server, testing::kTestSecret, "store");
  EXPECT_EQ(net::prove(c.client, testing::kTestSecret, "rendezvous", 3000),
            "is a scaletrain store, not a rendezvous: check the port");
  shutdown(c.client, SHUT_RDWR);
  server.get();
}

// A proof overheard on one connection opens no other: each is made on the server's fresh nonce.
TEST(Auth, AReplayedProofIsRefused) {
  std::string overheard;
  {
    Pair c;
    auto server = serve_one(c.server, testing::kTestSecret, "store");
    // Listen in on the client's proof by proving through a relay of our own.
    std::string hello;
    for (int i = 0; i < 300 && hello.find('\n') == std::string::npos; ++i) {
      net::read_available(c.client, hello);
      std::this_thread::sleep_for(milliseconds(10));
    }
    const std::string sn = hello.substr(hello.rfind(' ') + 1, 64);
    const std::string cn(64, 'c');
    overheard = "PROOF " + cn + " " +
                net::hmac_hex(testing::kTestSecret, "client store " + sn + " " + cn) + "\n";
    net::send_all(c.client, overheard);
    EXPECT_EQ(server.get(), net::Gate::Verdict::kPassed);
  }
  Pair c;
  auto server = serve_one(c.server, testing::kTestSecret, "store");
  std::string hello;
  for (int i = 0; i < 300 && hello.find('\n') == std::string::npos; ++i) {
    net::read_available(c.client, hello);
    std::this_thread::sleep_for(milliseconds(10));
  }
  net::send_all(c.client, overheard);
  EXPECT_EQ(server.get(), net::Gate::Verdict::kRefused);
}

// ---- The store's door ----------------------------------------------------------------------

// A raw client of a StoreServer: the handshake, then frames.
struct RawClient {
  int fd = -1;
  std::string in;
  RawClient(int port, const std::string& secret) {
    fd = net::connect_to("127.0.0.1", port, 1000);
    if (fd >= 0 && !net::prove(fd, secret, "store", 5000, &in).empty()) close(fd), fd = -1;
  }
  ~RawClient() {
    if (fd >= 0) close(fd);
  }
  std::vector<std::string> call(store_wire::Op op, const std::vector<std::string>& parts) {
    net::send_all(fd, store_wire::frame(static_cast<uint8_t>(op), parts));
    store_wire::Message m;
    const auto end = Clock::now() + std::chrono::seconds(10);
    while (store_wire::take_frame(in, &m) != store_wire::Parse::kOk && Clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      poll(&p, 1, 100);
      if (!net::read_available(fd, in)) break;
    }
    return m.parts;
  }
};

// Whether the server closed `fd` within `ms` (what it sent meanwhile lands in `*said`).
bool closed_within(int fd, int ms, std::string* said = nullptr) {
  std::string buf;
  const auto end = Clock::now() + milliseconds(ms);
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 20);
    if (!net::read_available(fd, buf)) {
      if (said) *said = buf;
      return true;
    }
  }
  if (said) *said = buf;
  return false;
}

StoreServerOptions store_options() {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.secret = testing::kTestSecret;
  o.log = [](const std::string&) {};
  return o;
}

// Regression AnyoneWhoReachedTheLighthouseJoinedAsAReplica: the lighthouse's store took a
// stranger's keys (a registration as replica 7, a forged ft/done) and gave it the job's. Now
// nothing a connection sends before its proof is read: a request in its place closes it, and
// the key never lands.
TEST(StoreServer, NothingIsReadBeforeTheProof) {
  StoreServer server(store_options());
  const int fd = net::connect_to("127.0.0.1", server.port(), 1000);
  ASSERT_GE(fd, 0);
  net::send_all(fd, store_wire::frame(static_cast<uint8_t>(store_wire::Op::kSet),
                                      {"ft/reg/7/stranger", "x"}));
  std::string said;
  EXPECT_TRUE(closed_within(fd, 3000, &said));
  close(fd);
  EXPECT_EQ(said.rfind("SCALETRAIN-AUTH 1 store ", 0), 0u) << said;  // the challenge: no data
  EXPECT_NE(said.find("REFUSED no proof of the job's secret"), std::string::npos) << said;
  EXPECT_FALSE(server.get("ft/reg/7/stranger"));
  RawClient wrong(server.port(), "another-secret-0123456789");
  EXPECT_LT(wrong.fd, 0);
  RawClient right(server.port(), testing::kTestSecret);
  ASSERT_GE(right.fd, 0);
  EXPECT_EQ(right.call(store_wire::Op::kSet, {"k", "v"}), std::vector<std::string>{});
  EXPECT_EQ(server.get("k"), std::optional<std::string>("v"));
}

TEST(StoreServer, AConnectionSilentPastItsDeadlineIsClosed) {
  auto o = store_options();
  o.limits.deadline = milliseconds(300);
  StoreServer server(o);
  const int fd = net::connect_to("127.0.0.1", server.port(), 1000);
  ASSERT_GE(fd, 0);
  const auto start = Clock::now();
  std::string said;
  EXPECT_TRUE(closed_within(fd, 5000, &said));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.0);
  EXPECT_NE(said.find("REFUSED no proof in time"), std::string::npos) << said;
  close(fd);
}

TEST(StoreServer, RequestsFollowTCPStoresRules) {
  StoreServer server(store_options());
  RawClient c(server.port(), testing::kTestSecret);
  ASSERT_GE(c.fd, 0);
  using store_wire::Op;
  EXPECT_EQ(c.call(Op::kAdd, {"n", "5"}), std::vector<std::string>{"5"});
  EXPECT_EQ(c.call(Op::kAdd, {"n", "-2"}), std::vector<std::string>{"3"});
  EXPECT_EQ(c.call(Op::kGet, {"n"}), std::vector<std::string>{"3"});  // a decimal, as TCPStore
  EXPECT_EQ(c.call(Op::kCheck, {"n", "m"}), std::vector<std::string>{"0"});
  EXPECT_EQ(c.call(Op::kCompareSet, {"m", "x", "y"}), std::vector<std::string>{"x"});
  EXPECT_EQ(c.call(Op::kCompareSet, {"m", "", "y"}), std::vector<std::string>{"y"});
  EXPECT_EQ(c.call(Op::kCompareSet, {"m", "z", "w"}), std::vector<std::string>{"y"});
  EXPECT_EQ(c.call(Op::kCompareSet, {"m", "y", "w"}), std::vector<std::string>{"w"});
  c.call(Op::kAppend, {"m", "2"});
  c.call(Op::kMultiSet, {"a", "1", "b", "2"});
  EXPECT_EQ(c.call(Op::kMultiGet, {"m", "a", "b"}), (std::vector<std::string>{"w2", "1", "2"}));
  EXPECT_EQ(c.call(Op::kNumKeys, {}), std::vector<std::string>{"4"});
  EXPECT_EQ(c.call(Op::kDelete, {"a"}), std::vector<std::string>{"1"});
  EXPECT_EQ(c.call(Op::kDelete, {"a"}), std::vector<std::string>{"0"});
  // A wait is answered once its keys exist, whoever sets them.
  auto waited = std::async(std::launch::async, [&] { return c.call(Op::kWait, {"late"}); });
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(waited.wait_for(milliseconds(0)), std::future_status::timeout);
  server.set("late", "1");
  EXPECT_EQ(waited.get(), std::vector<std::string>{});
}

// Regression AFloodOfConnectionsStalledTheLighthouse: ~4,000 connections took a job from 24 s
// to 430 s (about 10 accepts a second, 1,297 sockets left in CLOSE-WAIT). Now the backlog is
// drained as fast as it fills, at most 64 strangers wait at once (the oldest are closed), and a
// client that proves the secret gets in and is served meanwhile.
TEST(StoreServer, AFloodOfStrangersCostsTheJobNothing) {
  StoreServer server(store_options());
  std::atomic<bool> flooding{true};
  std::atomic<int> opened{0};
  std::thread flood([&] {
    std::vector<int> fds;
    while (flooding && opened < 4000) {
      const int fd = net::connect_to("127.0.0.1", server.port(), 1000);
      if (fd >= 0) fds.push_back(fd), ++opened;
      if (fds.size() > 600) {  // keep this process's own descriptors bounded
        for (size_t i = 0; i < 300; ++i) close(fds[i]);
        fds.erase(fds.begin(), fds.begin() + 300);
      }
    }
    for (int fd : fds) close(fd);
  });
  // The job's side: a new connection each round (as replicas' beats make), retried as AuthStore
  // retries when the door closed it among the strangers, until the flood has come through.
  int rounds = 0, tries = 0;
  double slowest = 0;
  const auto start = Clock::now();
  while ((opened < 3000 || rounds < 20) && Clock::now() - start < std::chrono::seconds(60)) {
    const auto t0 = Clock::now();
    std::vector<std::string> reply;
    while (reply.empty() && Clock::now() - t0 < std::chrono::seconds(10)) {
      ++tries;
      RawClient c(server.port(), testing::kTestSecret);
      if (c.fd >= 0) reply = c.call(store_wire::Op::kAdd, {"beats", "1"});
    }
    ASSERT_EQ(reply, std::vector<std::string>{std::to_string(++rounds)});
    slowest = std::max(slowest, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const int during = opened.load();
  flooding = false;
  flood.join();
  EXPECT_GT(during, 2000) << "the flood never got going: the test proves nothing";
  EXPECT_LT(slowest, 2.0) << rounds << " rounds, " << tries << " tries, " << during << " strangers";
}

// ---- Where servers listen ------------------------------------------------------------------

std::string bound_address(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  char text[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
  return text;
}

// This machine's first IPv4 address that is not loopback, or "".
std::string outside_address() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string found;
  for (ifaddrs* i = all; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  freeifaddrs(all);
  return found;
}

// Regression ElasticRendezvousListenedOnEveryInterfaceForLoopback: `--master-addr 127.0.0.1`
// bound 0.0.0.0, so every machine that could reach this one could talk to the rendezvous.
TEST(ListenOn, LoopbackStaysLoopbackAndAnAddressIsItsInterfaceAlone) {
  const int loopback = net::listen_on("127.0.0.1", 0);
  ASSERT_GE(loopback, 0);
  EXPECT_EQ(bound_address(loopback), "127.0.0.1");
  const std::string outside = outside_address();
  if (!outside.empty()) {  // not reachable from the other interface
    EXPECT_LT(net::connect_to(outside, net::bound_port(loopback), 500), 0);
    const int own = net::listen_on(outside, 0);
    ASSERT_GE(own, 0);
    EXPECT_EQ(bound_address(own), outside);
    close(own);
  }
  close(loopback);
  const int every = net::listen_on("0.0.0.0", 0);
  EXPECT_EQ(bound_address(every), "0.0.0.0");
  close(every);
  EXPECT_LT(net::listen_on("192.0.2.1", 0), 0) << "another machine's address (TEST-NET-1)";
}

// ---- Secrets ---------------------------------------------------------------------------------

TEST(Secret, AMissingFileIsMadeOnceAndAnOpenOneRefused) {
  testing::TempDir dir("secret_file");
  const std::string path = (dir.path / "job.secret").string();
  const std::string made = read_secret_file(path);
  EXPECT_EQ(made.size(), 64u);
  EXPECT_EQ(read_secret_file(path), made) << "read back, not made again";
  chmod(path.c_str(), 0644);
  try {
    read_secret_file(path);
    ADD_FAILURE() << "a secret file others may read was taken";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("chmod 600 " + path), std::string::npos) << e.what();
  }
}

// Regression SecretFileFollowedAPlantedSymlink: a link planted where the secret file should be
// (a folder others may write) made the first line of any of the user's files the job's secret,
// an ssh key's predictable "-----BEGIN OPENSSH PRIVATE KEY-----" among them. A link is refused,
// and so is a file of another user.
TEST(Secret, APlantedSymlinkOrAnotherUsersFileIsRefused) {
  testing::TempDir dir("secret_link");
  const std::string target = (dir.path / "id_key").string(),
                    link = (dir.path / "job.secret").string();
  { std::ofstream(target) << "-----BEGIN OPENSSH PRIVATE KEY-----\n"; }
  chmod(target.c_str(), 0600);
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  try {
    read_secret_file(link);
    ADD_FAILURE() << "a symbolic link was followed";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("it is a symbolic link"), std::string::npos) << e.what();
  }
  if (geteuid() == 0) {  // a file of another user: root can make one
    ASSERT_EQ(chown(target.c_str(), 65534, 65534), 0);
    try {
      read_secret_file(target);
      ADD_FAILURE() << "another user's file was taken";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("belongs to user 65534"), std::string::npos) << e.what();
    }
  }
}

// ---- The lighthouse's command --------------------------------------------------------------

TEST(LighthouseCommand, RefusesToStartWithoutASecret) {
  auto r = testing::run_command("env -u SCALETRAIN_SECRET -u SCALETRAIN_SECRET_FILE " +
                                testing::cli_path() + " lighthouse --port 0");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the lighthouse needs the job's secret"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SCALETRAIN_SECRET_FILE=PATH"), std::string::npos) << r.output;
}

// Regression AFloodOfConnectionsStalledTheLighthouse (its end): after the flood the lighthouse
// ignored SIGTERM. A flood of 3,000 connections from bash's /dev/tcp, then SIGTERM: it stops
// within a second or two, and says how many it refused.
TEST(LighthouseCommand, AFloodIsRefusedAndSigtermStillStopsIt) {
  const std::string script =
      "export SCALETRAIN_SECRET=" + std::string(testing::kTestSecret) + "\n" + testing::cli_path() +
      " lighthouse --host 127.0.0.1 --port 0 > $DIR/out 2>&1 &\n"
      "pid=$!\n"
      "for i in $(seq 100); do grep -q 'listening on port' $DIR/out && break; sleep 0.1; done\n"
      "port=$(sed -n 's/.*listening on port \\([0-9]*\\).*/\\1/p' $DIR/out)\n"
      "for i in $(seq 3000); do exec {fd}<>/dev/tcp/127.0.0.1/$port || break; done 2>/dev/null\n"
      "start=$(date +%s%N)\n"
      "kill -TERM $pid; wait $pid; status=$?\n"
      "echo \"stopped in $(( ($(date +%s%N) - start) / 1000000 )) ms, status $status\"\n"
      "cat $DIR/out\n";
  testing::TempDir dir("lighthouse_flood");
  auto r = testing::run_command(
      "DIR=" + dir.path.string() + " bash -c '" +
          [&] {
            std::string quoted;
            for (char c : script) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
            return quoted;
          }() +
          "'",
      120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.find("stopped in ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_LT(std::stoi(r.output.substr(at + 11)), 3000) << r.output;
  EXPECT_NE(r.output.find("status 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("lighthouse: refused"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace scaletrain
