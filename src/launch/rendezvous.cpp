#include "launch/rendezvous.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>

#include "launch/auth.h"
#include "launch/net.h"
#include "scaletrain/error.h"

namespace scaletrain::launch_detail {

// Note [Elastic rendezvous]: torchrun's `--nnodes MIN:MAX`, without a store in LibTorch. The
// launchers of an elastic job all connect to one address (--master-addr:--master-port); the one
// whose machine holds that address binds it first (that interface alone: loopback stays
// loopback) and hosts the server, as torchrun's c10d rendezvous does (its host must stay for the
// job's length: when it goes, the others say so and stop). Every connection first proves the
// job's secret (Note [Authenticated connections] in auth.cpp); nothing a connection says before
// is read. Only a member of the running round may end the job (DONE). The protocol is lines over
// TCP:
//   launcher -> server: JOIN <run id> <nproc> <port> <host:pid> <hosting 0|1>  (join)
//                       FAILED                                (this node's workers failed)
//                       DONE                                  (this node's workers all exited 0)
//                       BEAT                                  (every 0.5 s)
//   server -> launcher: ROUND <round> <node rank> <nnodes> <master addr> <master port> <restarts>
//                       RESTART <round> <reason>   (the round ended: stop the workers, join again)
//                       WAITING <joined> <min>     (a join's progress, for its timeout's message)
//                       SPARE <max>                (the world is full: it waits for a place)
//                       CLOSED <reason> | ABORT <reason> | REFUSED <reason>
//                       BEAT                       (every 0.5 s)
// A round's world is its nodes' workers, node 0's port (sent with its JOIN, free on its machine
// a moment before) on node 0's address being the workers' store (MASTER_ADDR, MASTER_PORT). The
// trainer, restarted at the new world size, resumes from the newest checkpoint (every strategy
// reshards). A launcher that goes silent (killed, its link down) has left once node_timeout_s
// passes without a line from it; one that closes its connection has left at once.

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kFailureSettleSeconds = 1.0;

bool is_loopback(const std::string& addr) { return addr.rfind("127.", 0) == 0; }

}  // namespace

// The server's rounds (Note [Elastic rendezvous]): its connections and what each node is in.
struct RendezvousServer::State {
  struct Conn {
    int fd = -1;
    int id = 0;
    std::string addr, host, buf;
    int nproc = 0, port = 0;
    bool hosting = false;
    bool joined = false, member = false, done = false, closed = false;
    std::string why_closed;
    Clock::time_point heard = Clock::now();
    std::string name() const {
      return fmt::format("node {} ({})", host.empty() ? "?" : host, addr);
    }
    void say(const std::string& line) {
      if (!closed && !net::send_all(fd, line + "\n")) {
        closed = true;
        why_closed = "its connection failed";
      }
    }
  };

  State(const RendezvousOptions& options, int listener)
      : o(options),
        door(listener, options.secret, "rendezvous", net::GateLimits{},
             [](const auto& m) { spdlog::warn("scaletrain run: rendezvous: {}", m); }) {}

  void admit();
  void read_all();
  void drop_closed();
  void settle_failure();
  void try_form();
  void beat();
  int members_busy() const;

  RendezvousOptions o;
  net::Doorman door;
  std::vector<Conn> conns;
  int next_id = 0;
  int round = 0;
  bool running = false, finished = false;
  std::string end_reason;
  int failures = 0;
  std::optional<Clock::time_point> enough_since, pending_failure, last_leave;
  Clock::time_point next_beat = Clock::now();
  int last_waiting = -1;
  std::mutex mu;
  std::condition_variable cv;

 private:
  void handle(Conn& c, const std::string& line);
  void join(Conn& c, std::istringstream& in);
  void recall(const std::string& reason);
  void finish(const std::string& kind, const std::string& reason);
  void form(const std::vector<Conn*>& joined);
};

std::unique_ptr<RendezvousServer> RendezvousServer::try_host(const RendezvousOptions& options) {
  const int fd = net::listen_on(options.host, options.port);
  if (fd < 0) return nullptr;
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(options, fd));
}

RendezvousServer::RendezvousServer(const RendezvousOptions& options, int listener)
    : listener_(listener), state_(std::make_unique<State>(options, listener)) {
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(listener_);
    throw Error(fmt::format("cannot create the rendezvous's wake pipe: {}", strerror(errno)));
  }
  thread_ = std::thread([this] { serve(); });
}

RendezvousServer::~RendezvousServer() {
  stop_ = true;
  [[maybe_unused]] auto n = write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (auto& c : state_->conns) close(c.fd);
  close(listener_);
  close(wake_[0]);
  close(wake_[1]);
}

void RendezvousServer::wait_for_members(double timeout_s, const std::atomic<int>* stop) {
  const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
  std::unique_lock<std::mutex> lock(state_->mu);
  while (members_busy_.load() != 0 && Clock::now() < end && !(stop && stop->load() != 0)) {
    state_->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
}

void RendezvousServer::serve() {
  State& s = *state_;
  while (!stop_) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    s.door.add_pollfds(fds);
    for (auto& c : s.conns) fds.push_back({c.fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    s.admit();
    s.read_all();
    s.drop_closed();
    s.settle_failure();
    s.try_form();
    s.beat();
    rounds_ = s.round;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      members_busy_ = s.members_busy();
    }
    s.cv.notify_all();
  }
}

// The connections that proved the job's secret join the conversation (Doorman).
void RendezvousServer::State::admit() {
  for (auto& p : door.step()) {
    Conn c;
    c.fd = p.fd;
    c.id = next_id++;
    c.addr = p.peer;
    c.buf = std::move(p.buf);
    conns.push_back(std::move(c));
  }
}

void RendezvousServer::State::read_all() {
  for (auto& c : conns) {
    if (c.closed) continue;
    const size_t had = c.buf.size();
    if (!net::read_available(c.fd, c.buf)) {
      c.closed = true;
      c.why_closed = "its connection closed (its launcher ended)";
    }
    if (c.buf.size() != had) c.heard = Clock::now();
    for (const auto& line : net::take_lines(c.buf)) handle(c, line);
    if (!c.closed && seconds_since(c.heard) > o.node_timeout_s) {
      const std::string why = fmt::format("no word from it for {:.1f} s", seconds_since(c.heard));
      c.say("DROPPED " + why);  // a node cut off one way, or whose link returns, still hears it
      c.closed = true;
      c.why_closed = why;
    }
  }
}

// A closed connection is a node that left: the round it was in ends.
void RendezvousServer::State::drop_closed() {
  for (auto it = conns.begin(); it != conns.end();) {
    if (!it->closed) {
      ++it;
      continue;
    }
    if ((it->member || it->joined) && !it->done) {
      spdlog::info("scaletrain run: rendezvous: {} left: {}", it->name(), it->why_closed);
    }
    if (it->member && !it->done) {
      last_leave = Clock::now();
      it->member = false;
      if (!finished) recall(it->name() + " left: " + it->why_closed);
    }
    close(it->fd);
    it = conns.erase(it);
  }
}

void RendezvousServer::State::handle(Conn& c, const std::string& line) {
  std::istringstream in(line);
  std::string verb;
  in >> verb;
  if (verb == "JOIN") return join(c, in);
  if (verb == "FAILED") {  // it stays a member until it joins again (or leaves)
    if (c.member && running) {
      pending_failure = Clock::now();
      recall("the workers of " + c.name() + " failed");
    }
  } else if (verb == "DONE") {
    if (!c.member) {  // only a node of the running round can know the job is done
      spdlog::warn("scaletrain run: rendezvous: {} said DONE without being in the round; ignored",
                   c.name());
      return;
    }
    c.done = true;
    c.member = false;
    if (!finished) {
      spdlog::info("scaletrain run: rendezvous: {} finished; the job is done", c.name());
      finish("CLOSED", "the job has finished");
    }
  }
}

void RendezvousServer::State::join(Conn& c, std::istringstream& in) {
  std::string run_id;
  int hosting = 0;
  in >> run_id >> c.nproc >> c.port >> c.host >> hosting;
  c.hosting = hosting == 1;
  if (run_id != o.run_id) {
    return c.say(fmt::format(
        "REFUSED its --run-id '{}' differs from the rendezvous host's '{}': give every node the "
        "same",
        run_id, o.run_id));
  }
  if (o.nproc > 0 && c.nproc != o.nproc) {
    return c.say(fmt::format(
        "REFUSED it has --nproc-per-node {} and the rendezvous host has {}: give every node the "
        "same",
        c.nproc, o.nproc));
  }
  if (finished) return c.say(end_reason);
  const bool was_member = c.member;
  c.member = false;
  c.joined = true;
  int members = 0;
  for (const auto& m : conns) members += m.member ? 1 : 0;
  if (was_member) {
    recall(c.name() + " left the round");
  } else if (running && members < o.max_nodes) {
    recall(c.name() + " joined");
  } else if (running) {
    c.say(fmt::format("SPARE {}", o.max_nodes));  // it joins when a node of the full world leaves
  }
}

void RendezvousServer::State::recall(const std::string& reason) {
  if (!running) return;
  running = false;
  spdlog::info("scaletrain run: rendezvous: round {} ends: {}", round, reason);
  for (auto& c : conns) {
    if (c.member) c.say(fmt::format("RESTART {} {}", round, reason));
  }
}

void RendezvousServer::State::finish(const std::string& kind, const std::string& reason) {
  finished = true;
  running = false;
  end_reason = kind + " " + reason;
  for (auto& c : conns) {
    if (c.joined || (kind == "ABORT" && c.member)) c.say(end_reason);
  }
}

// A failure counts against max_restarts unless a member left within a second of it.
void RendezvousServer::State::settle_failure() {
  if (!pending_failure || seconds_since(*pending_failure) < kFailureSettleSeconds) return;
  const auto at = *pending_failure;
  pending_failure.reset();
  const auto window = std::chrono::milliseconds(static_cast<int>(kFailureSettleSeconds * 1000));
  if (last_leave && *last_leave > at - window) {
    spdlog::info(
        "scaletrain run: rendezvous: a failure right after a node left counts as the leave's "
        "consequence, not as a restart");
    return;
  }
  failures += 1;
  if (failures > o.max_restarts) {
    finish("ABORT", fmt::format("the worker group failed {} time(s), more than --max-restarts {}",
                                failures, o.max_restarts));
  }
}

void RendezvousServer::State::try_form() {
  if (running || finished || pending_failure) return;
  for (const auto& c : conns) {
    if (c.member) return;  // a member of the last round is still stopping its workers
  }
  std::vector<Conn*> joined;
  for (auto& c : conns) {
    if (c.joined) joined.push_back(&c);
  }
  std::stable_sort(joined.begin(), joined.end(),
                   [](const Conn* x, const Conn* y) { return x->hosting && !y->hosting; });
  const int n = static_cast<int>(joined.size());
  if (n != last_waiting) {
    last_waiting = n;
    for (auto* c : joined) c->say(fmt::format("WAITING {} {}", n, o.min_nodes));
  }
  if (n < o.min_nodes) {
    enough_since.reset();
    return;
  }
  if (!enough_since) enough_since = Clock::now();
  if (n < o.max_nodes && seconds_since(*enough_since) < o.last_call_s) return;
  joined.resize(static_cast<size_t>(std::min(n, o.max_nodes)));
  form(joined);
}

void RendezvousServer::State::form(const std::vector<Conn*>& members) {
  round += 1;
  running = true;
  enough_since.reset();
  last_waiting = -1;
  const int k = static_cast<int>(members.size());
  // Node 0's address as the others reach it: the rendezvous's own where it joined by loopback.
  std::string addr = members[0]->addr;
  for (int i = 1; i < k && is_loopback(addr); ++i) {
    if (!is_loopback(members[static_cast<size_t>(i)]->addr)) addr = o.host;
  }
  std::string names;
  for (int i = 0; i < k; ++i) {
    Conn& c = *members[static_cast<size_t>(i)];
    c.joined = false;
    c.member = true;
    names += (i ? ", " : "") + c.name();
    c.say(fmt::format("ROUND {} {} {} {} {} {}", round, i, k, addr, members[0]->port, failures));
  }
  spdlog::info("scaletrain run: rendezvous: round {} formed: {} node(s): {}", round, k, names);
}

void RendezvousServer::State::beat() {
  if (Clock::now() < next_beat) return;
  next_beat =
      Clock::now() + std::chrono::milliseconds(static_cast<int>(kRendezvousBeatSeconds * 1000));
  for (auto& c : conns) c.say("BEAT");
}

int RendezvousServer::State::members_busy() const {
  int busy = 0;
  for (const auto& c : conns) busy += c.member && !c.done ? 1 : 0;
  return busy;
}

}  // namespace scaletrain::launch_detail
