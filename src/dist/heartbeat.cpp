#include "dist/heartbeat.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <sstream>

#include "dist/text.h"
#include "launch/net.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kAnswer{2000};  // how long a question to rank 0 waits for its answer

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string port_key(const World& w) {
  return "scaletrain/heartbeat/" + w.run_id + "/" + std::to_string(w.restart_count) + "/port";
}

// A TCP connection to host:port within `timeout`; -1 when there is none.
int connect_to(const std::string& host, int port, milliseconds timeout) {
  return net::connect_to(host, port, static_cast<int>(timeout.count()));
}

using net::send_all;

using dist_text::text;

}  // namespace

Heartbeat::Heartbeat(const World& world, c10d::Store& store, milliseconds interval)
    : world_(world), interval_(interval) {
  if (world_.rank == 0) {
    const bool loopback = world_.num_nodes == 1 &&
                          (world_.master_addr == "127.0.0.1" || world_.master_addr == "localhost");
    listener_ = net::bind_tcp(0, loopback, /*listen=*/true);
    if (listener_ < 0 || ::pipe2(wake_, O_CLOEXEC) != 0) {
      throw Error("rank 0: cannot open the heartbeat endpoint (" + std::string(strerror(errno)) +
                  "); set InitOptions::heartbeat_interval to 0 to go without");
    }
    port_ = net::bound_port(listener_);
    peers_.resize(static_cast<size_t>(world_.world_size));
    const std::string port = std::to_string(port_);
    store.set(port_key(world_), std::vector<uint8_t>(port.begin(), port.end()));
    thread_ = std::thread([this] { serve(); });
    return;
  }
  port_ = std::stoi(text(store.get(port_key(world_))));
  connection_ = connect_to(world_.master_addr, port_, kAnswer);
  const std::string hello = "hello " + std::to_string(world_.rank) + " host " + host_name() +
                            ", pid " + std::to_string(::getpid()) + "\n";
  if (connection_ >= 0 && send_all(connection_, hello)) thread_ = std::thread([this] { beat(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (wake_[1] >= 0) [[maybe_unused]]
    auto n = ::write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (int fd : {listener_, wake_[0], wake_[1], connection_}) {
    if (fd >= 0) ::close(fd);
  }
}

void Heartbeat::beat() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, interval_, [this] { return stop_; })) {
    // Never blocks: with rank 0 stopped the bytes queue up, and a full queue skips a beat.
    const ssize_t n = ::send(connection_, ".", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return;  // rank 0 ended: quietly
  }
}

namespace {

struct Connection {
  int fd = -1;
  std::string line;  // the first line, until its '\n'
  int rank = -1;     // after its hello
};

}  // namespace

void Heartbeat::serve() {
  std::vector<Connection> open;
  char buf[512];
  while (true) {
    std::vector<pollfd> fds{{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    for (const auto& c : open) fds.push_back({c.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) break;
    if (fds[1].revents != 0) break;
    std::vector<Connection> kept;
    for (size_t i = 0; i < open.size(); ++i) {
      Connection c = open[i];
      if (fds[i + 2].revents == 0) {
        kept.push_back(c);
        continue;
      }
      const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      std::lock_guard<std::mutex> lock(mu_);
      if (n <= 0) {  // closed: a rank that ended, or a question answered
        if (c.rank >= 0) peers_[static_cast<size_t>(c.rank)].left = true;
        ::close(c.fd);
        continue;
      }
      if (c.rank >= 0) {
        peers_[static_cast<size_t>(c.rank)].last = Clock::now();
        kept.push_back(c);
        continue;
      }
      c.line.append(buf, static_cast<size_t>(n));
      const auto end = c.line.find('\n');
      if (end == std::string::npos && c.line.size() < 256) {
        kept.push_back(c);
        continue;
      }
      std::istringstream first(c.line.substr(0, end));
      std::string word;
      int rank = -1;
      first >> word;
      if (word == "?") {
        send_all(c.fd, report() + "\n");
        ::close(c.fd);
        continue;
      }
      first >> rank;
      if (word != "hello" || rank <= 0 || rank >= world_.world_size) {
        ::close(c.fd);  // not one of ours
        continue;
      }
      std::string who;
      std::getline(first >> std::ws, who);
      peers_[static_cast<size_t>(rank)] = Peer{who, Clock::now(), false};
      c.rank = rank;
      kept.push_back(c);
    }
    if (fds[0].revents & POLLIN) {
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) kept.push_back(Connection{fd, "", -1});
    }
    open = std::move(kept);
  }
  for (const auto& c : open) ::close(c.fd);
}

// Rank 0's view; called with mu_ held.
std::string Heartbeat::report() const {
  const auto now = Clock::now();
  const auto late = 2 * interval_ + milliseconds(500);
  std::ostringstream out;
  int silent = 0;
  for (int r = 1; r < world_.world_size; ++r) {
    const Peer& p = peers_[static_cast<size_t>(r)];
    const bool quiet = now - p.last > late;
    if (!p.who.empty() && !p.left && !quiet) continue;
    out << (silent++ ? "; " : "") << "rank " << r;
    if (p.who.empty()) {
      out << ": never beat";
    } else if (p.left) {
      out << " (" << p.who << "): left (its process ended or closed its group)";
    } else {
      out.precision(1);
      out << " (" << p.who << "): no beat for " << std::fixed
          << std::chrono::duration<double>(now - p.last).count()
          << " s (stopped by a signal, frozen, or cut off from the network)";
    }
  }
  return silent == 0 ? "" : "not answering: " + out.str();
}

std::string Heartbeat::silent_ranks() const {
  if (world_.rank == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    return report();
  }
  const std::string rank0 = "not answering: rank 0, whose heartbeat endpoint at " +
                            world_.master_addr + ":" + std::to_string(port_) + " did not answer";
  const int fd = connect_to(world_.master_addr, port_, kAnswer);
  if (fd < 0) return rank0 + " (it is gone, or cut off from the network)";
  std::string answer;
  char buf[4096];
  pollfd p{fd, POLLIN, 0};
  const auto deadline = Clock::now() + kAnswer;
  bool complete = false;
  if (send_all(fd, "?\n")) {
    while (!complete && Clock::now() < deadline) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left.count()))) != 1) break;
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      answer.append(buf, static_cast<size_t>(n));
      complete = answer.find('\n') != std::string::npos;
    }
  }
  ::close(fd);
  if (!complete) return rank0 + " within 2 s (it is stopped by a signal, frozen, or cut off)";
  return answer.substr(0, answer.find('\n'));
}

}  // namespace scaletrain
