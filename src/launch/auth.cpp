#include "launch/auth.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

#include "launch/net.h"
#include "scaletrain/error.h"

namespace scaletrain::net {

// Note [Authenticated connections]: the handshake, in lines, before anything else on a
// connection (Note [Job secret] says where the secret comes from):
//
//   server -> client   SCALETRAIN-AUTH 1 <service> <server nonce>
//   client -> server   PROOF <client nonce> <HMAC(secret, "client <service> <sn> <cn>")>
//   server -> client   OK <HMAC(secret, "server <service> <sn> <cn>")>  |  REFUSED <why>
//
// Nonces are 32 random bytes in hexadecimal. Each side proves the secret on the other's fresh
// nonce, so no proof can be replayed, and the secret never crosses the wire. The client checks
// the server's proof too: a process that took the job's port cannot pose as its server and hear
// what the job says. The service in both proofs keeps a proof for the rendezvous from opening
// the store. What this does not do: encrypt, or authenticate each message after the handshake.
// An attacker who can rewrite the packets of a connection (on its path, not merely able to reach
// the port) is outside this model; run jobs on a network you trust against that, or a VPN
// (docs/launcher.md, "Threat model").
//
// The servers keep connections that have not proved anything on a short leash (GateLimits): a
// deadline for the proof, and at most max_waiting of them at once, the oldest closed first.

namespace {

constexpr const char* kMagic = "SCALETRAIN-AUTH";
constexpr size_t kMaxHandshakeLine = 512;

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1) {
    throw Error("cannot draw a random nonce: the system's random source failed");
  }
  std::string hex;
  for (unsigned char c : raw) hex += fmt::format("{:02x}", c);
  return hex;
}

bool same(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string client_mac(const std::string& secret, const std::string& service, const std::string& sn,
                       const std::string& cn) {
  return hmac_hex(secret, "client " + service + " " + sn + " " + cn);
}

std::string server_mac(const std::string& secret, const std::string& service, const std::string& sn,
                       const std::string& cn) {
  return hmac_hex(secret, "server " + service + " " + sn + " " + cn);
}

// One line from `fd` before `deadline`; bytes after it stay in `buf`. "" and `why` set when none.
bool read_line(int fd, std::string& buf, std::chrono::steady_clock::time_point deadline,
               std::string* line, std::string* why) {
  while (true) {
    const auto end = buf.find('\n');
    if (end != std::string::npos) {
      *line = buf.substr(0, end);
      buf.erase(0, end + 1);
      return true;
    }
    if (buf.size() > kMaxHandshakeLine) {
      *why = "sent a line too long for a handshake (another program on the port?)";
      return false;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    const int ready = left.count() > 0 ? poll(&p, 1, static_cast<int>(left.count())) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      *why =
          "did not answer in time (a busy or stopped server, or another program on the "
          "port)";
      return false;
    }
    char chunk[512];
    const ssize_t n = recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n <= 0) {
      *why = "closed the connection during the handshake";
      return false;
    }
    buf.append(chunk, static_cast<size_t>(n));
  }
}

}  // namespace

std::string hmac_hex(const std::string& key, const std::string& message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out,
           &len) == nullptr) {
    throw Error("HMAC-SHA256 failed in OpenSSL");
  }
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", out[i]);
  return hex;
}

Gate::Gate(const std::string& secret, const std::string& service)
    : secret_(secret), service_(service), nonce_(random_hex(32)) {
  hello_ = fmt::format("{} 1 {} {}\n", kMagic, service_, nonce_);
}

Gate::Verdict Gate::take(std::string& buf, std::string* reply) {
  const auto end = buf.find('\n');
  const std::string proof_word = "PROOF ";
  if (buf.compare(0, std::min(buf.size(), proof_word.size()), proof_word, 0,
                  std::min(buf.size(), proof_word.size())) != 0) {  // anything else: at once
    *reply = "REFUSED no proof of the job's secret\n";
    return Verdict::kRefused;
  }
  if (end == std::string::npos) {
    if (buf.size() <= kMaxHandshakeLine) return Verdict::kWaiting;
    *reply = "REFUSED no proof of the job's secret\n";
    return Verdict::kRefused;
  }
  std::istringstream in(buf.substr(0, end));
  buf.erase(0, end + 1);
  std::string word, cn, mac;
  in >> word >> cn >> mac;
  if (word != "PROOF" || cn.size() != 64 || mac.empty()) {
    *reply = "REFUSED no proof of the job's secret\n";
    return Verdict::kRefused;
  }
  if (!same(mac, client_mac(secret_, service_, nonce_, cn))) {
    *reply = "REFUSED wrong secret\n";
    return Verdict::kRefused;
  }
  *reply = "OK " + server_mac(secret_, service_, nonce_, cn) + "\n";
  return Verdict::kPassed;
}

std::string prove(int fd, const std::string& secret, const std::string& service, int timeout_ms,
                  std::string* rest) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string buf, line, why;
  if (!read_line(fd, buf, deadline, &line, &why)) return why;
  std::istringstream hello(line);
  std::string magic, version, theirs, sn;
  hello >> magic >> version >> theirs >> sn;
  if (magic != kMagic || version != "1") {
    return "does not speak scaletrain's handshake (another program, or an older scaletrain, "
           "on the port?)";
  }
  if (theirs != service) {
    return fmt::format("is a scaletrain {}, not a {}: check the port", theirs, service);
  }
  const std::string cn = random_hex(32);
  if (!send_all(fd, fmt::format("PROOF {} {}\n", cn, client_mac(secret, service, sn, cn)))) {
    return "closed the connection during the handshake";
  }
  if (!read_line(fd, buf, deadline, &line, &why)) return why;
  if (line.rfind("REFUSED ", 0) == 0) return "refused this process: " + line.substr(8);
  if (line.rfind("OK ", 0) != 0 || !same(line.substr(3), server_mac(secret, service, sn, cn))) {
    return "does not hold this job's secret (another job's server on the port?)";
  }
  if (rest != nullptr) rest->append(buf);
  return "";
}

bool is_wrong_secret(const std::string& why) {
  return why.find("wrong secret") != std::string::npos ||
         why.find("does not hold this job's secret") != std::string::npos;
}

void RefusalLog::add(const std::string& peer, const std::string& why) {
  if (count_++ == 0) first_ = fmt::format("{} ({})", peer.empty() ? "?" : peer, why);
  flush();
}

void RefusalLog::flush(bool now) {
  const auto t = std::chrono::steady_clock::now();
  if (count_ == 0 || (!now && t - last_ < std::chrono::seconds(5))) return;
  last_ = t;
  sink_(count_ == 1 ? "refused a connection from " + first_
                    : fmt::format("refused {} connections, the first from {}", count_, first_));
  count_ = 0;
}

Doorman::Doorman(int listener, std::string secret, std::string service, GateLimits limits,
                 std::function<void(const std::string&)> log)
    : listener_(listener),
      secret_(std::move(secret)),
      service_(std::move(service)),
      limits_(limits),
      refusals_(std::move(log)) {
  fcntl(listener_, F_SETFL, fcntl(listener_, F_GETFL) | O_NONBLOCK);  // accept_all() drains it
}

Doorman::~Doorman() {
  refusals_.flush(true);
  for (auto& w : waiting_) close(w.fd);
}

void Doorman::add_pollfds(std::vector<pollfd>& fds) const {
  if (std::chrono::steady_clock::now() >= no_fds_until_) fds.push_back({listener_, POLLIN, 0});
  for (const auto& w : waiting_) fds.push_back({w.fd, POLLIN, 0});
}

void Doorman::refuse(Waiting& w, const std::string& reply, const std::string& why) {
  if (!reply.empty()) send(w.fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  close(w.fd);
  w.fd = -1;
  refusals_.add(w.peer, why);
}

// Everything the backlog holds: a flood is drained as fast as it comes, and past max_waiting
// it closes its own oldest connections.
void Doorman::accept_all() {
  const auto now = std::chrono::steady_clock::now();
  if (now < no_fds_until_) return;
  while (true) {
    const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {  // out of descriptors: shed the oldest waiting
        if (!waiting_.empty()) {
          refuse(waiting_.front(), "", "closed: out of file descriptors");
          waiting_.pop_front();
        }
        no_fds_until_ = now + std::chrono::milliseconds(50);  // else poll spins on the listener
      }
      return;
    }
    waiting_.push_back(Waiting{fd, peer_address(fd), "", Gate(secret_, service_), now});
    const std::string& hello = waiting_.back().gate.hello();
    send(fd, hello.data(), hello.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    while (waiting_.size() > limits_.max_waiting) {
      refuse(waiting_.front(), "REFUSED too many connections without a proof\n",
             "closed unproved: too many waiting");
      waiting_.pop_front();
    }
  }
}

std::vector<Doorman::Passed> Doorman::step() {
  accept_all();
  std::vector<Passed> passed;
  const auto now = std::chrono::steady_clock::now();
  for (auto& w : waiting_) {
    const bool open = read_available(w.fd, w.buf);
    std::string reply;
    const Gate::Verdict v = w.gate.take(w.buf, &reply);
    if (v == Gate::Verdict::kPassed && send_all(w.fd, reply)) {
      passed.push_back(Passed{w.fd, w.peer, std::move(w.buf)});
      w.fd = -1;
    } else if (v == Gate::Verdict::kRefused) {
      refuse(w, reply, reply.substr(reply.find(' ') + 1, reply.size() - reply.find(' ') - 2));
    } else if (!open) {
      refuse(w, "", "closed before its proof");
    } else if (now - w.since > limits_.deadline) {
      refuse(w, "REFUSED no proof in time\n", "no proof in time");
    }
  }
  waiting_.erase(
      std::remove_if(waiting_.begin(), waiting_.end(), [](const Waiting& w) { return w.fd < 0; }),
      waiting_.end());
  refusals_.flush();
  return passed;
}

}  // namespace scaletrain::net
