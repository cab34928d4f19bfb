// AuthStore (src/dist/auth_store.h), the c10d::Store that proves the job's secret, against
// PyTorch's own TCPStore: the same requests through both give the same answers, so Gloo, NCCL
// and the library's rendezvous see one store as the other. Every run_ranks() test also runs its
// process groups over it (tests/support/ranks.h).
#include "dist/auth_store.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/error.h"
#include "support/secret.h"

namespace scaletrain {
namespace {

using std::chrono::milliseconds;

std::shared_ptr<StoreServer> test_server() {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.secret = testing::kTestSecret;
  o.log = [](const std::string&) {};
  return std::make_shared<StoreServer>(o);
}

AuthStoreOptions client_options(int port, const std::string& secret = testing::kTestSecret) {
  AuthStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.secret = secret;
  o.what = "the test's store";
  o.timeout = std::chrono::seconds(5);
  return o;
}

std::vector<uint8_t> b(const std::string& s) { return {s.begin(), s.end()}; }
std::string s(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

// A script of requests, and what each answered ("!" and the error's kind where it threw).
std::vector<std::string> script(c10d::Store& store) {
  std::vector<std::string> out;
  auto note = [&out](auto&& call) {
    try {
      out.push_back(call());
    } catch (const c10::DistStoreError&) {
      out.push_back("!store error");
    } catch (const c10::DistError&) {
      out.push_back("!dist error");
    }
  };
  note([&] { return (store.set("a", b("1")), std::string("set")); });
  note([&] { return s(store.get("a")); });
  note([&] { return std::to_string(store.add("n", 5)); });
  note([&] { return std::to_string(store.add("n", -2)); });
  note([&] { return s(store.get("n")); });
  note([&] { return std::to_string(store.check({"a", "n"})); });
  note([&] { return std::to_string(store.check({"a", "missing"})); });
  note([&] { return s(store.compareSet("m", b(""), b("x"))); });
  note([&] { return s(store.compareSet("m", b("q"), b("y"))); });
  note([&] { return s(store.compareSet("m", b("x"), b("y"))); });
  note([&] { return s(store.compareSet("absent", b("expected"), b("z"))); });
  note([&] { return std::to_string(store.check({"absent"})); });
  note([&] { return (store.append("a", b("2")), s(store.get("a"))); });
  note([&] { return (store.multiSet({"p", "q"}, {b("1"), b("2")}), std::string("multiSet")); });
  note([&] {
    auto v = store.multiGet({"q", "p", "m"});
    return s(v.at(0)) + s(v.at(1)) + s(v.at(2));
  });
  note([&] { return std::to_string(store.deleteKey("p")); });
  note([&] { return std::to_string(store.deleteKey("p")); });
  note([&] { return (store.wait({"a", "q"}), std::string("waited")); });
  note([&] { return (store.wait({"never"}, milliseconds(200)), std::string("waited")); });
  note([&] { return (store.set("after", b("ok")), s(store.get("after"))); });  // still usable
  return out;
}

TEST(AuthStore, AnswersEveryRequestAsTCPStoreDoes) {
  auto server = test_server();
  auto ours = c10::make_intrusive<AuthStore>(client_options(server->port()), server);
  c10d::TCPStoreOptions to;
  to.port = 0;
  to.isServer = true;
  to.waitWorkers = false;
  to.timeout = std::chrono::seconds(5);
  auto theirs = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", to);
  EXPECT_EQ(script(*ours), script(*theirs));
  // Under a prefix, as every process group sees it.
  c10d::PrefixStore our_group("group/x", ours), their_group("group/x", theirs);
  EXPECT_EQ(script(our_group), script(their_group));
}

TEST(AuthStore, ACloneAndManyThreadsShareOneStore) {
  auto server = test_server();
  auto store = c10::make_intrusive<AuthStore>(client_options(server->port()), server);
  auto clone = store->clone();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      c10d::Store& mine = t % 2 ? *clone : static_cast<c10d::Store&>(*store);
      for (int i = 0; i < 50; ++i) mine.add("count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(store->add("count", 0), 200);
}

// Regression LighthouseDeathWas113FramesOfBacktrace, at the store: a server that goes while a
// client waits is one line naming it and its address, at once.
TEST(AuthStore, AServerThatGoesIsOneLineNamingIt) {
  auto server = test_server();
  const int port = server->port();
  auto store = c10::make_intrusive<AuthStore>(client_options(port));
  auto waiting = std::async(std::launch::async, [&]() -> std::string {
    try {
      store->wait({"never"}, std::chrono::seconds(30));
    } catch (const c10::DistNetworkError& e) {
      return e.what_without_backtrace();
    }
    return "";
  });
  std::this_thread::sleep_for(milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  server.reset();
  const std::string why = waiting.get();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3.0);
  EXPECT_EQ(why, "the test's store at 127.0.0.1:" + std::to_string(port) +
                     " closed the connection (wait for never): it stopped or was killed");
}

TEST(AuthStore, AnotherSecretIsAUsageErrorWithTheFix) {
  auto server = test_server();
  try {
    AuthStore store(client_options(server->port(), "another-secret-0123456789"));
    ADD_FAILURE() << "connected with another secret";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("refused this process: wrong secret: give every process "
                                         "of the job the same secret (SCALETRAIN_SECRET_FILE"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace scaletrain
