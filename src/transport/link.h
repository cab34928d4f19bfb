#pragma once
// Point-to-point messages between ranks on one machine through shared memory (internal, not
// public API; LibTorch-free). Note [Shared-memory links] in link.cpp.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace scaletrain {

/// One pair of ranks, both directions: a segment with a byte ring per direction. Made by one
/// side (create), mapped by the other (attach, with create's name()).
class SharedLink {
 public:
  struct Options {
    int64_t ring_bytes = 8 << 20;  // per direction; a longer message passes through in parts
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // per wait
    int rank = 0;                                                 // this side's, for errors
    int peer = 1;                                                 // the other side's
  };

  static std::unique_ptr<SharedLink> create(const Options& options);
  /// Throws Error when the segment is not reachable from here (another machine, another PID
  /// namespace) or was made for another ring size.
  static std::unique_ptr<SharedLink> attach(const std::string& name, const Options& options);
  /// Marks this side as gone (a peer waiting on it fails at once) and unmaps.
  ~SharedLink();
  SharedLink(const SharedLink&) = delete;
  SharedLink& operator=(const SharedLink&) = delete;

  const std::string& name() const { return name_; }
  /// Removes the name once both sides have mapped the segment.
  void unlink();

  struct Layout;
  struct State;  // this side's queues: sends not yet written, receives posted, messages held

 private:
  friend class LinkSet;
  SharedLink(std::string name, const Options& options, void* base, size_t bytes, int side);
  bool pump();  // moves what it can, both ways, without waiting; true if anything moved
  bool push();
  bool pull();
  void start_message();
  void end_message();
  void ring_peer();
  [[noreturn]] void wrong_length(size_t expected) const;  // of the message being read
  [[noreturn]] void wrong_length(size_t expected, int32_t tag, size_t length) const;
  std::string trouble(const std::string& what,
                      std::optional<std::chrono::steady_clock::time_point> start) const;

  std::string name_;
  Options options_;
  void* base_;
  size_t bytes_;
  int side_;  // 0: create's, 1: attach's
  std::unique_ptr<State> state_;
  std::string broken_;  // the error that broke the stream, thrown again at every later use
  bool unlinked_ = false;
};

/// A rank's links, by peer rank: sends and receives matched by (peer, tag), in order per tag,
/// as c10d's. A wait on one link moves the others' messages too, so that ranks blocked on each
/// other's full rings never wait in a cycle. Not for concurrent use by threads.
class LinkSet {
 public:
  LinkSet();
  ~LinkSet();
  LinkSet(LinkSet&&) noexcept;
  LinkSet& operator=(LinkSet&&) noexcept;
  void add(int peer, std::unique_ptr<SharedLink> link);
  bool has(int peer) const { return links_.count(peer) != 0; }

  /// Queues `bytes` at `data` for `peer` under `tag` and writes what fits now. `data` must stay
  /// untouched until sent(); `owner`, held until then, keeps it alive (a send dropped unwaited
  /// after a failure). Returns the send's ticket.
  uint64_t send(int peer, int32_t tag, const void* data, size_t bytes,
                std::shared_ptr<const void> owner = nullptr);
  bool sent(int peer, uint64_t ticket);
  void wait_sent(int peer, uint64_t ticket, const std::string& what);

  /// Posts a receive of `bytes` into `data` of the next message from `peer` under `tag`. A
  /// message of another length is an Error. Returns the receive's ticket.
  uint64_t post(int peer, int32_t tag, void* data, size_t bytes);
  bool received(int peer, uint64_t ticket);
  void wait_received(int peer, uint64_t ticket, const std::string& what);
  /// Why `peer` cannot answer any more (gone, its process dead), or "": what a poll of sent() or
  /// received() checks to see a failure without waiting.
  std::string failure(int peer, const std::string& what) const;
  /// Withdraws a posted receive not yet complete (a message half read into it is dropped).
  void withdraw(int peer, uint64_t ticket);

 private:
  SharedLink& link(int peer) const;
  bool pump_all();
  template <typename Done>
  void wait(int peer, Done done, const std::string& what);
  std::map<int, std::unique_ptr<SharedLink>> links_;
};

}  // namespace scaletrain
