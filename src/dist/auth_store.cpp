#include "dist/auth_store.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "dist/store_wire.h"
#include "dist/text.h"
#include "launch/auth.h"
#include "launch/net.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using store_wire::Op;

std::string bytes_text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> text_bytes(const std::string& s) { return {s.begin(), s.end()}; }

using dist_text::seconds;

int left_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left, 1 << 30)));
}

// All of `s` before `deadline`; false when the peer closed or took nothing in time.
bool send_before(int fd, const std::string& s, Clock::time_point deadline) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, left_ms(deadline)) != 1) return false;
      continue;
    }
    return false;
  }
  return true;
}

}  // namespace

AuthStore::AuthStore(AuthStoreOptions options, std::shared_ptr<StoreServer> server)
    : c10d::Store(options.timeout), o_(std::move(options)), server_(std::move(server)) {
  std::lock_guard<std::mutex> lock(mu_);
  connect(o_.timeout);
}

AuthStore::~AuthStore() { drop(); }

void AuthStore::drop() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  in_.clear();
}

// A connection that proved the secret, retried until `timeout` (the server may not listen yet,
// or a flood of strangers may have crowded this one out at its door). Holds mu_.
void AuthStore::connect(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string why = "no connection";
  while (true) {
    const int fd =
        net::connect_to(o_.host, o_.port, std::max(1, std::min(1000, left_ms(deadline))));
    if (fd >= 0) {
      std::string rest;
      why = net::prove(fd, o_.secret, o_.service, std::max(1, std::min(5000, left_ms(deadline))),
                       &rest);
      if (why.empty()) {
        fd_ = fd;
        in_ = rest;
        return;
      }
      close(fd);
      if (net::is_wrong_secret(why)) {
        throw UsageError(o_.what + " at " + address() + " " + why +
                         ": give every process of the job the same secret (SCALETRAIN_SECRET_FILE "
                         "or SCALETRAIN_SECRET)");
      }
    } else {
      why = errno == ECONNREFUSED ? "nothing listens there" : strerror(errno);
    }
    if (Clock::now() >= deadline) {
      throw c10::DistNetworkError(o_.what + " at " + address() + " cannot be reached within " +
                                  seconds(timeout) + " (" + why + ")");
    }
    std::this_thread::sleep_for(milliseconds(std::min(100, left_ms(deadline) + 1)));
  }
}

std::vector<std::string> AuthStore::request(uint8_t op, const std::vector<std::string>& parts,
                                            milliseconds timeout, const std::string& doing) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) connect(timeout);
  const auto deadline = Clock::now() + timeout;
  if (!send_before(fd_, store_wire::frame(op, parts), deadline)) {
    drop();
    throw c10::DistNetworkError(o_.what + " at " + address() + " took no request for " +
                                seconds(timeout) + " (" + doing +
                                "): it stopped, was killed or is cut off");
  }
  store_wire::Message m;
  while (true) {
    const auto parse = store_wire::take_frame(in_, &m);
    if (parse == store_wire::Parse::kOk) break;
    if (parse == store_wire::Parse::kBad) {
      drop();
      throw c10::DistNetworkError(o_.what + " at " + address() + " sent a malformed reply (" +
                                  doing + ")");
    }
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, left_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      drop();  // the server may still answer: this connection can no longer be trusted
      throw c10::DistStoreError(doing + " on " + o_.what + " at " + address() +
                                " timed out after " + seconds(timeout));
    }
    char chunk[65536];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      in_.append(chunk, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      drop();
      throw c10::DistNetworkError(o_.what + " at " + address() + " closed the connection (" +
                                  doing + "): it stopped or was killed");
    }
  }
  if (m.code != 0) {
    throw c10::DistStoreError(o_.what + " at " + address() + ": " +
                              (m.parts.empty() ? "failed" : m.parts[0]));
  }
  return m.parts;
}

c10::intrusive_ptr<c10d::Store> AuthStore::clone() {
  return c10::make_intrusive<AuthStore>(o_, server_);
}

void AuthStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  request(static_cast<uint8_t>(Op::kSet), {key, bytes_text(value)}, timeout_, "set " + key);
}

std::vector<uint8_t> AuthStore::compareSet(const std::string& key,
                                           const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) {
  auto r =
      request(static_cast<uint8_t>(Op::kCompareSet),
              {key, bytes_text(expected), bytes_text(desired)}, timeout_, "compare-set " + key);
  return text_bytes(r.at(0));
}

std::vector<uint8_t> AuthStore::get(const std::string& key) {
  auto r = request(static_cast<uint8_t>(Op::kGet), {key}, timeout_, "get " + key);
  return text_bytes(r.at(0));
}

int64_t AuthStore::add(const std::string& key, int64_t value) {
  auto r =
      request(static_cast<uint8_t>(Op::kAdd), {key, std::to_string(value)}, timeout_, "add " + key);
  return std::stoll(r.at(0));
}

bool AuthStore::deleteKey(const std::string& key) {
  return request(static_cast<uint8_t>(Op::kDelete), {key}, timeout_, "delete " + key).at(0) == "1";
}

bool AuthStore::check(const std::vector<std::string>& keys) {
  return request(static_cast<uint8_t>(Op::kCheck), keys, timeout_, "check").at(0) == "1";
}

int64_t AuthStore::getNumKeys() {
  return std::stoll(request(static_cast<uint8_t>(Op::kNumKeys), {}, timeout_, "count").at(0));
}

void AuthStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void AuthStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  std::string what = "wait for ";
  for (size_t i = 0; i < keys.size() && i < 3; ++i) what += (i ? ", " : "") + keys[i];
  if (keys.size() > 3) what += " and " + std::to_string(keys.size() - 3) + " more";
  request(static_cast<uint8_t>(Op::kWait), keys, timeout, what);
}

void AuthStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  request(static_cast<uint8_t>(Op::kAppend), {key, bytes_text(value)}, timeout_, "append " + key);
}

std::vector<std::vector<uint8_t>> AuthStore::multiGet(const std::vector<std::string>& keys) {
  std::vector<std::vector<uint8_t>> out;
  for (auto& v : request(static_cast<uint8_t>(Op::kMultiGet), keys, timeout_, "multi-get")) {
    out.push_back(text_bytes(v));
  }
  return out;
}

void AuthStore::multiSet(const std::vector<std::string>& keys,
                         const std::vector<std::vector<uint8_t>>& values) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < keys.size() && i < values.size(); ++i) {
    parts.push_back(keys[i]);
    parts.push_back(bytes_text(values[i]));
  }
  request(static_cast<uint8_t>(Op::kMultiSet), parts, timeout_, "multi-set");
}

}  // namespace scaletrain
