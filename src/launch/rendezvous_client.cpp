// The launcher's side of the rendezvous (Note [Elastic rendezvous] in rendezvous.cpp).
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

namespace {

using Clock = std::chrono::steady_clock;

std::string this_host() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "unknown";
  for (char* c = name; *c != '\0'; ++c) {
    if (*c == ' ') *c = '_';
  }
  return std::string(name) + ":" + std::to_string(getpid());  // one host may run several
}

}  // namespace

RendezvousClient::RendezvousClient(const RendezvousOptions& options, bool hosting,
                                   const std::atomic<int>* stop_signal, bool refused_is_final)
    : o_(options), hosting_(hosting), stop_signal_(stop_signal) {
  const auto start = Clock::now();
  std::string unproved;  // why the last connection's handshake failed
  while ((fd_ = connect_proved(&unproved)) < 0) {
    if (stop_signal_ && stop_signal_->load() != 0) {
      throw Error("scaletrain run: interrupted while waiting for the rendezvous");
    }
    if (refused_is_final && errno == ECONNREFUSED) {
      throw Error(fmt::format(
          "the rendezvous host {}:{} is reachable again but refuses the connection: its launcher "
          "has ended (the job finished or stopped while this node was cut off); see the host's "
          "log",
          o_.host, o_.port));
    }
    if (seconds_since(start) > o_.join_timeout_s) {
      throw Error(fmt::format(
          "cannot reach the rendezvous at {}:{} for {:.0f} s (--rdzv-timeout){}: start the "
          "launcher of the machine that has address {} (it hosts the rendezvous), or check "
          "--master-addr/--master-port",
          o_.host, o_.port, o_.join_timeout_s,
          unproved.empty() ? "" : "; the last connection's handshake failed: " + unproved,
          o_.host));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(fd_);
    throw Error(fmt::format("cannot create the rendezvous's wake pipe: {}", strerror(errno)));
  }
  thread_ = std::thread([this] { run(); });
}

// A connection that proved the job's secret (Note [Authenticated connections]), or -1: errno
// set where no connection was made, `why` where the handshake failed. A host that holds another
// secret is an error at once: waiting would not change it.
int RendezvousClient::connect_proved(std::string* why) {
  const int fd = net::connect_to(o_.host, o_.port, 1000);
  if (fd < 0) return -1;
  *why = net::prove(fd, o_.secret, "rendezvous", 5000, &early_);
  if (why->empty()) return fd;
  close(fd);
  errno = 0;
  if (net::is_wrong_secret(*why)) {
    throw UsageError(
        fmt::format("the rendezvous at {}:{} {}: every node of a job needs the same secret "
                    "(SCALETRAIN_SECRET_FILE or SCALETRAIN_SECRET; docs/launcher.md)",
                    o_.host, o_.port, *why));
  }
  return -1;
}

RendezvousClient::~RendezvousClient() {
  stop_ = true;
  [[maybe_unused]] auto n = write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  close(fd_);
  close(wake_[0]);
  close(wake_[1]);
}

void RendezvousClient::send_line(const std::string& line) {
  std::lock_guard<std::mutex> lock(send_mu_);
  // A line sent in part would run into the next one: the connection is given up instead, and
  // run() reports it lost.
  if (!net::send_all(fd_, line + "\n")) shutdown(fd_, SHUT_RDWR);
}

void RendezvousClient::run() {
  std::string buf = std::move(early_);
  auto heard = Clock::now(), next_beat = Clock::now();
  auto lost = [&](const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.push_back("LOST " + why);
    cv_.notify_all();
  };
  while (!stop_) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    poll(fds, 2, 100);
    const size_t had = buf.size();
    const bool open = net::read_available(fd_, buf);
    if (buf.size() != had) heard = Clock::now();
    for (auto& line : net::take_lines(buf)) {
      if (line == "BEAT") continue;
      if (line.rfind("DROPPED ", 0) == 0) {  // the host counted this node gone: cut off
        cut_off_ = true;
        return lost(fmt::format("the rendezvous host {}:{} dropped this node: {} (--node-timeout)",
                                o_.host, o_.port, line.substr(8)));
      }
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.push_back(std::move(line));
      cv_.notify_all();
    }
    if (!open) {
      return lost(
          fmt::format("the rendezvous host {}:{} closed the connection (its launcher ended)",
                      o_.host, o_.port));
    }
    if (seconds_since(heard) > o_.node_timeout_s) {
      cut_off_ = true;
      shutdown(fd_, SHUT_RDWR);  // the host, if it still hears this node, sees it go at once
      return lost(
          fmt::format("no word from the rendezvous host {}:{} for {:.1f} s (--node-timeout)",
                      o_.host, o_.port, seconds_since(heard)));
    }
    if (Clock::now() >= next_beat) {
      next_beat =
          Clock::now() + std::chrono::milliseconds(static_cast<int>(kRendezvousBeatSeconds * 1000));
      send_line("BEAT");
    }
  }
}

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A message that ends the current round.
bool is_recall(const std::string& m) {
  return starts_with(m, "RESTART") || starts_with(m, "ABORT") || starts_with(m, "LOST");
}

std::string rest_after(const std::string& line, int words) {
  size_t at = 0;
  for (int i = 0; i < words && at != std::string::npos; ++i) {
    at = line.find(' ', at);
    if (at != std::string::npos) at += 1;
  }
  return at == std::string::npos ? "" : line.substr(at);
}

}  // namespace

Round RendezvousClient::join(int nproc, int port) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::deque<std::string> kept;  // the last round's RESTART and progress are stale now
    for (auto& m : inbox_) {
      if (!starts_with(m, "RESTART") && !starts_with(m, "WAITING") && !starts_with(m, "SPARE"))
        kept.push_back(std::move(m));
    }
    inbox_.swap(kept);
  }
  send_line(
      fmt::format("JOIN {} {} {} {} {}", o_.run_id, nproc, port, this_host(), hosting_ ? 1 : 0));
  const auto start = Clock::now();
  int joined = 0, spare_of = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    while (!inbox_.empty()) {
      const std::string m = inbox_.front();
      inbox_.pop_front();
      std::istringstream in(m);
      std::string verb;
      in >> verb;
      Round r;
      if (verb == "ROUND") {
        in >> r.round >> r.node_rank >> r.nnodes >> r.master_addr >> r.master_port >> r.restarts;
        return r;
      }
      if (verb == "WAITING") in >> joined;
      if (verb == "SPARE") in >> spare_of;
      if (verb == "CLOSED" || verb == "ABORT") {
        r.kind = verb == "CLOSED" ? Round::kClosed : Round::kAborted;
        r.reason = rest_after(m, 1);
        return r;
      }
      if (verb == "REFUSED") {
        throw UsageError("the rendezvous at " + o_.host + ":" + std::to_string(o_.port) +
                         " refused this node: " + rest_after(m, 1));
      }
      if (verb == "LOST") throw Error("scaletrain run: " + rest_after(m, 1));
    }
    if (stop_signal_ && stop_signal_->load() != 0) {
      Round r;
      r.kind = Round::kAborted;
      r.reason = "interrupted";
      return r;
    }
    if (seconds_since(start) > o_.join_timeout_s && spare_of > 0) {
      throw Error(fmt::format(
          "scaletrain run: this node waited {:.0f} s (--rdzv-timeout) at the rendezvous {}:{} as "
          "a spare: the world is full ({} nodes, the most --nnodes allows) and no node left",
          o_.join_timeout_s, o_.host, o_.port, spare_of));
    }
    if (seconds_since(start) > o_.join_timeout_s) {
      throw Error(fmt::format(
          "scaletrain run: no round formed at the rendezvous {}:{} within {:.0f} s "
          "(--rdzv-timeout): {} node(s) there, --nnodes asks for at least {}; start the others",
          o_.host, o_.port, o_.join_timeout_s, joined, o_.min_nodes));
    }
    cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
}

bool RendezvousClient::recalled() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& m : inbox_) {
    if (is_recall(m)) return true;
  }
  return false;
}

std::string RendezvousClient::take_recall(const std::string& verb) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
    if (is_recall(*it) && (verb.empty() || starts_with(*it, (verb + " ").c_str()))) {
      std::string m = *it;
      inbox_.erase(it);
      return m;
    }
  }
  return "";
}

void RendezvousClient::report_failed() { send_line("FAILED"); }
void RendezvousClient::report_done() { send_line("DONE"); }

}  // namespace scaletrain::launch_detail
