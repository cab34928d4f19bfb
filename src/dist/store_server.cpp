#include "dist/store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>

#include "dist/store_wire.h"
#include "launch/net.h"
#include "scaletrain/error.h"

namespace scaletrain {

// Note [Store protocol]: c10d's TCPStore, with a door (Note [Authenticated connections]). A
// connection proves the job's secret first; then each request is one frame (store_wire.h) and
// gets one reply, in order. GET, WAIT and MULTI_GET are parked until their keys exist; a client
// that stops waiting closes its connection (and makes a new one for its next request), so a
// parked request never answers the wrong question. Values are bytes; ADD keeps a decimal number,
// as TCPStore does, so that GET reads it. COMPARE_SET is TCPStore's: a missing key is set only
// when the expected value is empty, and the reply is the value after.
//
// One thread serves every connection with poll(); the map is also reached in process (the
// lighthouse owns its server and reads its keys without a socket), under one mutex.

namespace {

using store_wire::Message;
using store_wire::Op;

std::string decimal(int64_t v) { return std::to_string(v); }

}  // namespace

struct StoreServer::Core {
  struct Conn {
    int fd = -1;
    std::string peer, in, out;
    std::optional<Message> parked;
    bool closed = false;
  };

  Core(const StoreServerOptions& options, int listener)
      : o(options),
        door(
            listener, options.secret, options.service, options.limits,
            options.log ? options.log : [service = options.service](const std::string& m) {
              spdlog::warn("scaletrain {}: {}", service, m);
            }) {}

  void admit();
  void read(Conn& c);
  void answer_parked();
  void flush(Conn& c);
  // The reply to `m`, or nothing when it must wait (parked).
  std::optional<std::string> execute(const Message& m);
  std::optional<std::string> execute_locked(const Message& m);

  StoreServerOptions o;
  net::Doorman door;
  mutable std::mutex mu;
  mutable std::condition_variable changed;
  std::unordered_map<std::string, std::string> kv;
  uint64_t version = 0;
  std::vector<Conn> conns;  // the server thread's alone
};

namespace {

std::string ok(const std::vector<std::string>& parts = {}) { return store_wire::frame(0, parts); }
std::string failed(const std::string& why) { return store_wire::frame(1, {why}); }

bool has_all(const std::unordered_map<std::string, std::string>& kv,
             const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    if (kv.count(k) == 0) return false;
  }
  return true;
}

}  // namespace

std::optional<std::string> StoreServer::Core::execute(const Message& m) {
  std::lock_guard<std::mutex> lock(mu);
  const uint64_t before = version;
  auto reply = execute_locked(m);
  if (version != before) changed.notify_all();
  return reply;
}

std::optional<std::string> StoreServer::Core::execute_locked(const Message& m) {
  const auto& p = m.parts;
  auto need = [&p](size_t n) { return p.size() == n; };
  switch (static_cast<Op>(m.code)) {
    case Op::kSet:
      if (!need(2)) break;
      kv[p[0]] = p[1];
      ++version;
      return ok();
    case Op::kGet:
      if (!need(1)) break;
      if (kv.count(p[0]) == 0) return std::nullopt;
      return ok({kv[p[0]]});
    case Op::kAdd: {
      if (!need(2)) break;
      int64_t now = 0;
      auto it = kv.find(p[0]);
      try {
        now = (it == kv.end() ? 0 : std::stoll(it->second)) + std::stoll(p[1]);
      } catch (const std::exception&) {
        return failed("add: the value of '" + p[0] + "' is not a number");
      }
      kv[p[0]] = decimal(now);
      ++version;
      return ok({decimal(now)});
    }
    case Op::kCheck:
      return ok({has_all(kv, p) ? "1" : "0"});
    case Op::kWait:
      if (!has_all(kv, p)) return std::nullopt;
      return ok();
    case Op::kDelete: {
      if (!need(1)) break;
      const bool erased = kv.erase(p[0]) > 0;
      version += erased ? 1 : 0;
      return ok({erased ? "1" : "0"});
    }
    case Op::kNumKeys:
      return ok({decimal(static_cast<int64_t>(kv.size()))});
    case Op::kCompareSet: {
      if (!need(3)) break;
      auto it = kv.find(p[0]);
      if (it == kv.end()) {
        if (!p[1].empty()) return ok({p[1]});
        kv[p[0]] = p[2];
        ++version;
        return ok({p[2]});
      }
      if (it->second == p[1]) it->second = p[2], ++version;
      return ok({it->second});
    }
    case Op::kAppend:
      if (!need(2)) break;
      kv[p[0]] += p[1];
      ++version;
      return ok();
    case Op::kMultiGet: {
      if (!has_all(kv, p)) return std::nullopt;
      std::vector<std::string> values;
      for (const auto& k : p) values.push_back(kv[k]);
      return ok(values);
    }
    case Op::kMultiSet:
      if (p.size() % 2 != 0) break;
      for (size_t i = 0; i < p.size(); i += 2) kv[p[i]] = p[i + 1];
      ++version;
      return ok();
  }
  return failed(fmt::format("malformed request (code {}, {} parts)", m.code, p.size()));
}

void StoreServer::Core::admit() {
  for (auto& p : door.step()) {
    Conn c;
    c.fd = p.fd;
    c.peer = p.peer;
    c.in = std::move(p.buf);
    conns.push_back(std::move(c));
  }
}

// What `c` sent, and the replies to its whole requests (a parked one holds the rest back: a
// client sends its next request only after the reply).
void StoreServer::Core::read(Conn& c) {
  char chunk[65536];
  while (!c.closed) {
    const ssize_t n = recv(c.fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(chunk, static_cast<size_t>(n));
      if (c.in.size() > store_wire::kMaxFrame + 8) c.closed = true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) c.closed = true;
    break;
  }
  Message m;
  while (!c.closed && !c.parked) {
    const auto parse = store_wire::take_frame(c.in, &m);
    if (parse == store_wire::Parse::kIncomplete) break;
    if (parse == store_wire::Parse::kBad) {
      c.closed = true;
      break;
    }
    if (auto reply = execute(m)) {
      c.out += *reply;
    } else {
      c.parked = std::move(m);
    }
  }
}

void StoreServer::Core::answer_parked() {
  for (auto& c : conns) {
    if (!c.parked || c.closed) continue;
    if (auto reply = execute(*c.parked)) {
      c.out += *reply;
      c.parked.reset();
      read(c);  // what it sent meanwhile (nothing, from our client)
    }
  }
}

void StoreServer::Core::flush(Conn& c) {
  while (!c.out.empty() && !c.closed) {
    const ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;  // POLLOUT says when
    c.closed = true;
  }
}

StoreServer::StoreServer(StoreServerOptions options) {
  listener_ = net::listen_on(options.host, options.port);
  if (listener_ < 0) {
    throw Error(fmt::format(
        "cannot listen on {}:{}: {}", options.host, options.port,
        errno == EADDRNOTAVAIL ? "not an address of this machine" : std::string(strerror(errno))));
  }
  fcntl(listener_, F_SETFL, fcntl(listener_, F_GETFL) | O_NONBLOCK);
  port_ = net::bound_port(listener_);
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(listener_);
    throw Error(fmt::format("cannot create the store's wake pipe: {}", strerror(errno)));
  }
  core_ = std::make_unique<Core>(options, listener_);
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() {
  stop_ = true;
  [[maybe_unused]] auto n = write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (auto& c : core_->conns) close(c.fd);
  core_.reset();  // the door closes its waiting connections
  close(listener_);
  close(wake_[0]);
  close(wake_[1]);
}

void StoreServer::serve() {
  Core& s = *core_;
  uint64_t seen = 0;
  while (!stop_) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    s.door.add_pollfds(fds);
    for (const auto& c : s.conns) {
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
    }
    poll(fds.data(), fds.size(), 100);
    char drain[64];
    while (read(wake_[0], drain, sizeof(drain)) > 0) {
    }
    s.admit();
    for (auto& c : s.conns) s.read(c);
    if (changes() != seen) {  // a key changed: some parked request may be answered now
      seen = changes();
      s.answer_parked();
    }
    for (auto& c : s.conns) s.flush(c);
    for (auto it = s.conns.begin(); it != s.conns.end();) {
      if (!it->closed) {
        ++it;
        continue;
      }
      close(it->fd);
      it = s.conns.erase(it);
    }
    clients_ = s.conns.size();
  }
}

void StoreServer::set(const std::string& key, const std::string& value) {
  core_->execute(Message{static_cast<uint8_t>(Op::kSet), {key, value}});
  [[maybe_unused]] auto n = write(wake_[1], "x", 1);  // parked requests may be answered now
}

std::optional<std::string> StoreServer::get(const std::string& key) const {
  std::lock_guard<std::mutex> lock(core_->mu);
  auto it = core_->kv.find(key);
  if (it == core_->kv.end()) return std::nullopt;
  return it->second;
}

int64_t StoreServer::add(const std::string& key, int64_t delta) {
  const auto reply = core_->execute(Message{static_cast<uint8_t>(Op::kAdd), {key, decimal(delta)}});
  [[maybe_unused]] auto n = write(wake_[1], "x", 1);
  Message m;
  std::string r = *reply;
  store_wire::take_frame(r, &m);
  if (m.code != 0) throw Error("store: " + m.parts.at(0));
  return std::stoll(m.parts.at(0));
}

bool StoreServer::erase(const std::string& key) {
  std::lock_guard<std::mutex> lock(core_->mu);
  const bool erased = core_->kv.erase(key) > 0;
  if (erased) ++core_->version, core_->changed.notify_all();
  return erased;
}

std::vector<std::string> StoreServer::keys(const std::string& prefix) const {
  std::lock_guard<std::mutex> lock(core_->mu);
  std::vector<std::string> out;
  for (const auto& [k, v] : core_->kv) {
    if (k.compare(0, prefix.size(), prefix) == 0) out.push_back(k);
  }
  return out;
}

uint64_t StoreServer::changes() const {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->version;
}

bool StoreServer::wait_for_change(uint64_t seen, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(core_->mu);
  return core_->changed.wait_for(lock, timeout, [&] { return core_->version != seen; });
}

}  // namespace scaletrain
