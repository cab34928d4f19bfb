#pragma once
// Authenticated connections (internal, not public API; Note [Authenticated connections] in
// auth.cpp): the handshake every server of a job — the workers' store, the elastic rendezvous,
// the lighthouse — asks of a connection before it reads anything else, and the limits that keep
// connections that never prove anything from crowding out the job's own.

#include <poll.h>

#include <chrono>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace scaletrain::net {

/// A server's first words to a new connection, and what it makes of the answer.
class Gate {
 public:
  /// `service` names the server ("store", "rendezvous", "lighthouse"): a proof for one is no
  /// proof for another.
  Gate(const std::string& secret, const std::string& service);

  /// The challenge, sent at once: "SCALETRAIN-AUTH 1 <service> <nonce>\n".
  const std::string& hello() const { return hello_; }

  enum class Verdict { kWaiting, kPassed, kRefused };
  /// Reads the client's proof from the start of `buf` once a whole line is there (taken out of
  /// `buf`; what follows it stays). kPassed: `reply` is the server's own proof, to send before
  /// anything else. kRefused: `reply` says why, to send before closing.
  Verdict take(std::string& buf, std::string* reply);

 private:
  std::string secret_, service_, nonce_, hello_;
};

/// On a connected socket: reads the server's challenge, proves `secret`, and checks the server's
/// proof, all within `timeout_ms`. Returns "" when both sides hold the secret, else why not in
/// words, to follow "the server at HOST:PORT" ("refused this process: wrong secret"). Bytes the
/// server sent after its proof are appended to `*rest`.
std::string prove(int fd, const std::string& secret, const std::string& service, int timeout_ms,
                  std::string* rest = nullptr);

/// Whether a refusal came from a server whose secret differs (not a timeout or a closed socket).
bool is_wrong_secret(const std::string& why);

/// The limits on connections that have not proved the secret yet.
struct GateLimits {
  /// At most this many wait at once: a new one past it closes the oldest waiting one (a flood
  /// then costs its own connections, never the job's, whose proofs take a round trip).
  size_t max_waiting = 64;
  /// A connection that has not proved the secret this long after it was accepted is closed.
  std::chrono::milliseconds deadline{5000};
};

/// A server's count of refused connections, told in one line at most every few seconds instead
/// of a line per connection (a flood would otherwise flood the log too).
class RefusalLog {
 public:
  explicit RefusalLog(std::function<void(const std::string&)> sink) : sink_(std::move(sink)) {}
  /// One refused connection from `peer`, because `why`.
  void add(const std::string& peer, const std::string& why);
  /// Tells what was counted when the last line is old enough (or `now` is set).
  void flush(bool now = false);

 private:
  std::function<void(const std::string&)> sink_;
  int count_ = 0;
  std::string first_;
  std::chrono::steady_clock::time_point last_{};  // the first refusal is told at once
};

/// The door of a server's listening socket: accepts connections, challenges each, and hands on
/// those that proved the secret; the refused, the late and the oldest past max_waiting are
/// closed (Note [Authenticated connections]). Driven by the server's own poll loop; not
/// thread-safe.
class Doorman {
 public:
  /// `listener`: a listening socket (owned by the caller; made non-blocking). `log` is told of
  /// refusals.
  Doorman(int listener, std::string secret, std::string service, GateLimits limits,
          std::function<void(const std::string&)> log);
  ~Doorman();
  Doorman(const Doorman&) = delete;
  Doorman& operator=(const Doorman&) = delete;

  /// The descriptors to poll for reading: the listener's (unless out of descriptors a moment
  /// ago) and the waiting connections'.
  void add_pollfds(std::vector<pollfd>& fds) const;

  struct Passed {
    int fd = -1;       // non-blocking, close-on-exec; the caller's to close
    std::string peer;  // its numeric address
    std::string buf;   // bytes it sent after its proof
  };
  /// Accepts what the listener holds, reads the proofs that came, closes the refused and the
  /// late. Returns the connections that passed.
  std::vector<Passed> step();
  /// Connections waiting for their proof now.
  size_t waiting() const { return waiting_.size(); }

 private:
  struct Waiting {
    int fd;
    std::string peer, buf;
    Gate gate;
    std::chrono::steady_clock::time_point since;
  };
  void accept_all();
  void refuse(Waiting& w, const std::string& reply, const std::string& why);

  int listener_;
  std::string secret_, service_;
  GateLimits limits_;
  RefusalLog refusals_;
  std::deque<Waiting> waiting_;
  std::chrono::steady_clock::time_point no_fds_until_{};
};

/// HMAC-SHA256 of `message` under `key`, as 64 hexadecimal characters (exposed for tests).
std::string hmac_hex(const std::string& key, const std::string& message);

}  // namespace scaletrain::net
