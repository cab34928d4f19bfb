// Note [Shared-memory links]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Pipeline stages on one machine hand activations and gradients to their neighbours. Over
// Gloo each message crosses the loopback device and two I/O threads per process, which on a
// busy machine take the cores the stages compute on (`bench pipeline-ranks`: 1F1B at 0.71 of
// its theory at m = 32). A link is one segment per pair of ranks with one byte ring per
// direction; the caller's own thread copies in and out:
//
//   segment:  header | side 0, side 1: pid, gone, doorbell | ring 0, ring 1: head, tail | data
//   message:  tag (4 bytes), 4 unused, length (8 bytes), then the bytes
//
// Ring d is written by side d alone (its tail) and read by the other side alone (its head), so
// a ring needs no lock: the writer copies into the free part and publishes the new tail, the
// reader copies out what lies before it and publishes the new head. Either then bumps the other
// side's doorbell and wakes it (futex). A message longer than the ring passes in parts.
//
// Sends are queued and written as the ring has room; receives are posted with their buffer, and
// an arriving message goes straight into the first posted buffer of its tag, or into a held
// copy until one is posted (messages of a tag stay in order, as c10d's do). Every wait of a
// rank moves everything it can on every link of its LinkSet: two ranks whose rings are full
// each read what the other wrote, so they never wait in a cycle. A waiter spins ~50 us, then
// sleeps on its doorbell in naps (1 ms with several links, 20 ms with one); after each nap it
// looks for trouble, so no wait hangs: the peer marked gone (its link destroyed, e.g. while its
// thread unwound an error), the peer's process dead, stopped by a signal, or the wait past the
// timeout; the error names the peer.

#include "transport/link.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <set>

#include "runtime/proc_tree.h"
#include "scaletrain/error.h"
#include "transport/segment.h"

namespace scaletrain {
namespace {

constexpr uint64_t kMagic = 0x7363616c656c6b31ULL;  // "scalelk1"
constexpr size_t kHeader = 16;                      // a message's tag and length
constexpr uint64_t kDrop = ~uint64_t{0};            // a withdrawn receive's message

}  // namespace

struct SharedLink::Layout {
  struct alignas(64) Side {
    std::atomic<int32_t> pid;
    std::atomic<int32_t> gone;
    std::atomic<uint32_t> doorbell;  // bumped when this side has something new to look at
  };
  struct alignas(64) Ring {
    std::atomic<uint64_t> head;  // bytes read, ever
    std::atomic<uint64_t> tail;  // bytes written, ever
  };
  struct Header {
    uint64_t magic;
    uint64_t pid_ns;
    int64_t ring_bytes;
    Side side[2];
    Ring ring[2];
  };
  static size_t bytes(int64_t ring) { return shm::align_up(sizeof(Header)) + 2 * size_t(ring); }
  static Header& header(void* base) { return *static_cast<Header*>(base); }
  static char* data(void* base, int d, int64_t ring) {
    return static_cast<char*>(base) + shm::align_up(sizeof(Header)) + size_t(d) * size_t(ring);
  }
};

struct SharedLink::State {
  struct Out {
    uint64_t ticket;
    char header[kHeader];
    const char* data;
    size_t bytes, done = 0;             // done counts the header's bytes too
    std::shared_ptr<const void> owner;  // keeps `data` alive until written
  };
  struct In {  // a posted receive
    uint64_t ticket;
    char* data;
    size_t bytes;
  };
  std::deque<Out> out;
  uint64_t next_send = 1, next_recv = 1;
  uint64_t sent_below = 1;  // every send with a smaller ticket is written
  std::map<int32_t, std::deque<In>> posted;
  std::map<int32_t, std::deque<std::vector<char>>> held;  // arrived, not yet asked for
  std::set<uint64_t> completed;                           // receives filled (tickets)
  // The message being read: its header so far, then where its bytes go.
  char header[kHeader];
  size_t header_got = 0;
  int32_t tag = 0;
  size_t length = 0, got = 0;
  char* dest = nullptr;
  uint64_t dest_ticket = 0;  // 0: into `holding`, then `held`
  std::vector<char> holding;
};

SharedLink::SharedLink(std::string name, const Options& options, void* base, size_t bytes, int side)
    : name_(std::move(name)),
      options_(options),
      base_(base),
      bytes_(bytes),
      side_(side),
      state_(new State) {
  Layout::header(base_).side[side_].pid.store(static_cast<int32_t>(getpid()));
}

std::unique_ptr<SharedLink> SharedLink::create(const Options& o) {
  if (o.ring_bytes < 64) throw Error("SharedLink: rings of at least 64 bytes");
  const auto seg = shm::create(Layout::bytes(o.ring_bytes));
  auto& h = Layout::header(seg.base);  // zero-filled: empty rings, nobody gone
  h.magic = kMagic;
  h.pid_ns = shm::pid_namespace();
  h.ring_bytes = o.ring_bytes;
  return std::unique_ptr<SharedLink>(new SharedLink(seg.name, o, seg.base, seg.bytes, 0));
}

std::unique_ptr<SharedLink> SharedLink::attach(const std::string& name, const Options& o) {
  const auto seg = shm::open(name, Layout::bytes(o.ring_bytes));
  const auto& h = Layout::header(seg.base);
  if (h.magic != kMagic || h.ring_bytes != o.ring_bytes || h.pid_ns != shm::pid_namespace()) {
    shm::close(seg);
    throw Error("shared segment " + name + " belongs to another link or PID namespace");
  }
  return std::unique_ptr<SharedLink>(new SharedLink(seg.name, o, seg.base, seg.bytes, 1));
}

SharedLink::~SharedLink() {
  Layout::header(base_).side[side_].gone.store(1);
  ring_peer();  // a waiting peer looks now
  shm::close({name_, base_, bytes_});
  if (side_ == 0 && !unlinked_) shm_unlink(name_.c_str());  // never mapped by the peer
}

// Tells the other side it has something new to look at.
void SharedLink::ring_peer() {
  auto& bell = Layout::header(base_).side[1 - side_].doorbell;
  bell.fetch_add(1, std::memory_order_acq_rel);
  shm::wake(&bell);
}

void SharedLink::unlink() {
  shm_unlink(name_.c_str());
  unlinked_ = true;
}

namespace {

// n bytes into / out of a ring of `cap` bytes at `ring`, from position `pos` (wrapping).
void to_ring(char* ring, size_t cap, uint64_t pos, const char* from, size_t n) {
  const size_t at = static_cast<size_t>(pos % cap), first = std::min(n, cap - at);
  std::memcpy(ring + at, from, first);
  std::memcpy(ring, from + first, n - first);
}
void from_ring(const char* ring, size_t cap, uint64_t pos, char* to, size_t n) {
  const size_t at = static_cast<size_t>(pos % cap), first = std::min(n, cap - at);
  std::memcpy(to, ring + at, first);
  std::memcpy(to + first, ring, n - first);
}

}  // namespace

// Writes queued sends into the outgoing ring while it has room.
bool SharedLink::push() {
  auto& h = Layout::header(base_);
  auto& ring = h.ring[side_];
  const size_t cap = static_cast<size_t>(h.ring_bytes);
  char* data = Layout::data(base_, side_, h.ring_bytes);
  State& s = *state_;
  uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  const uint64_t start = tail;
  while (!s.out.empty()) {
    State::Out& o = s.out.front();
    if (o.done == kHeader + o.bytes) {  // written (an empty message: its header alone)
      s.sent_below = o.ticket + 1;
      s.out.pop_front();
      continue;
    }
    const size_t room = cap - static_cast<size_t>(tail - ring.head.load(std::memory_order_acquire));
    if (room == 0) break;
    if (o.done < kHeader) {
      const size_t n = std::min(room, kHeader - o.done);
      to_ring(data, cap, tail, o.header + o.done, n);
      o.done += n;
      tail += n;
      continue;
    }
    const size_t n = std::min(room, o.bytes - (o.done - kHeader));
    to_ring(data, cap, tail, o.data + (o.done - kHeader), n);
    o.done += n;
    tail += n;
  }
  if (tail == start) return false;
  ring.tail.store(tail, std::memory_order_release);
  ring_peer();
  return true;
}

// Reads what the peer wrote: into the posted receive of the message's tag, else into a copy held
// until one is posted.
bool SharedLink::pull() {
  auto& h = Layout::header(base_);
  auto& ring = h.ring[1 - side_];
  const size_t cap = static_cast<size_t>(h.ring_bytes);
  char* data = Layout::data(base_, 1 - side_, h.ring_bytes);
  State& s = *state_;
  uint64_t head = ring.head.load(std::memory_order_relaxed);
  const uint64_t start = head, tail = ring.tail.load(std::memory_order_acquire);
  while (head < tail) {
    const size_t ready = static_cast<size_t>(tail - head);
    if (s.header_got < kHeader) {
      const size_t n = std::min(ready, kHeader - s.header_got);
      from_ring(data, cap, head, s.header + s.header_got, n);
      s.header_got += n;
      head += n;
      if (s.header_got == kHeader) start_message();
    } else {
      const size_t n = std::min(ready, s.length - s.got);
      if (s.dest != nullptr) from_ring(data, cap, head, s.dest + s.got, n);
      s.got += n;
      head += n;
    }
    if (s.header_got == kHeader && s.got == s.length) end_message();
  }
  if (head == start) return false;
  ring.head.store(head, std::memory_order_release);
  ring_peer();
  return true;
}

// A message's header is in: its bytes go to the first receive posted under its tag, or held.
void SharedLink::start_message() {
  State& s = *state_;
  uint64_t length = 0;
  std::memcpy(&s.tag, s.header, sizeof(s.tag));
  std::memcpy(&length, s.header + 8, sizeof(length));
  s.length = static_cast<size_t>(length);
  s.got = 0;
  auto p = s.posted.find(s.tag);
  if (p != s.posted.end() && !p->second.empty()) {
    const State::In in = p->second.front();
    p->second.pop_front();
    if (in.bytes != s.length) wrong_length(in.bytes);
    s.dest = in.data;
    s.dest_ticket = in.ticket;
  } else {
    s.holding.assign(s.length, 0);
    s.dest = s.holding.data();
    s.dest_ticket = 0;
  }
}

void SharedLink::wrong_length(size_t expected) const {
  wrong_length(expected, state_->tag, state_->length);
}

void SharedLink::wrong_length(size_t expected, int32_t tag, size_t length) const {
  throw Error("rank " + std::to_string(options_.rank) + ": a message from rank " +
              std::to_string(options_.peer) + " under tag " + std::to_string(tag) + " has " +
              std::to_string(length) + " bytes; the receive posted for it expects " +
              std::to_string(expected));
}

void SharedLink::end_message() {
  State& s = *state_;
  if (s.dest_ticket == 0) {
    s.held[s.tag].push_back(std::move(s.holding));
    s.holding = {};
  } else if (s.dest_ticket != kDrop) {
    s.completed.insert(s.dest_ticket);
  }
  s.header_got = 0;
  s.got = s.length = 0;
  s.dest = nullptr;
  s.dest_ticket = 0;
}

bool SharedLink::pump() {
  if (!broken_.empty()) throw Error(broken_);
  try {
    const bool out = push();
    const bool in = pull();
    return out || in;
  } catch (const Error& e) {  // its stream is out of step from here: every later use fails
    broken_ = e.what();
    throw;
  }
}

// What keeps the peer from answering, or "": it is gone, dead, or (with `start`) the wait began
// longer than the timeout ago. Read before a last look at the rings: whatever the peer wrote
// before it left is still read.
std::string SharedLink::trouble(const std::string& what,
                                std::optional<std::chrono::steady_clock::time_point> start) const {
  const auto& other = Layout::header(base_).side[1 - side_];
  const int pid = other.pid.load();
  const std::string me = "rank " + std::to_string(options_.rank) + ": " +
                         (what.empty() ? "a point-to-point transfer" : what) + ": rank " +
                         std::to_string(options_.peer);
  if (other.gone.load() != 0) {
    return me + " left (its pipeline was destroyed, e.g. by an error) before sending or " +
           "reading it. Its own error, above or in its log, says why.";
  }
  if (shm::exited(pid)) {
    return me + " (pid " + std::to_string(pid) + ") exited. Its own error, above or in its " +
           "log, says why.";
  }
  if (start && std::chrono::steady_clock::now() - *start > options_.timeout) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", std::chrono::duration<double>(options_.timeout).count());
    return me + " never answered: timed out after " + secs + " s" +
           (proc::is_stopped(pid)
                ? "; it (pid " + std::to_string(pid) + ") is stopped by a signal: `kill -CONT " +
                      std::to_string(pid) + "` lets it go on"
                : "");
  }
  return "";
}

LinkSet::LinkSet() = default;
LinkSet::~LinkSet() = default;
LinkSet::LinkSet(LinkSet&&) noexcept = default;
LinkSet& LinkSet::operator=(LinkSet&&) noexcept = default;

void LinkSet::add(int peer, std::unique_ptr<SharedLink> link) { links_[peer] = std::move(link); }

SharedLink& LinkSet::link(int peer) const {
  auto it = links_.find(peer);
  if (it == links_.end()) throw Error("no shared-memory link to rank " + std::to_string(peer));
  return *it->second;
}

bool LinkSet::pump_all() {
  bool moved = false;
  for (auto& l : links_) moved = l.second->pump() || moved;
  return moved;
}

// Moves messages on every link until done(); spins a little, then sleeps on `peer`'s doorbell.
// After each nap it looks at the peer whatever moved elsewhere, so traffic on other links never
// holds off the timeout.
template <typename Done>
void LinkSet::wait(int peer, Done done, const std::string& what) {
  SharedLink& l = link(peer);
  auto& bell = SharedLink::Layout::header(l.base_).side[l.side_].doorbell;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  while (clock::now() - start < std::chrono::microseconds(50)) {
    pump_all();
    if (done()) return;
    shm::cpu_relax();
  }
  const auto every = std::chrono::milliseconds(links_.size() > 1 ? 1 : 20);
  const timespec nap{0, static_cast<long>(every.count()) * 1000 * 1000};
  auto look = clock::now() + every;
  while (true) {
    const uint32_t seen = bell.load(std::memory_order_acquire);
    std::string trouble;
    if (clock::now() >= look) {
      trouble = l.trouble(what, start);
      look = clock::now() + every;
    }
    const bool moved = pump_all();
    if (done()) return;
    if (!trouble.empty()) throw Error(trouble);
    if (!moved) shm::wait(&bell, seen, nap);
  }
}

std::string LinkSet::failure(int peer, const std::string& what) const {
  return link(peer).trouble(what, std::nullopt);
}

uint64_t LinkSet::send(int peer, int32_t tag, const void* data, size_t bytes,
                       std::shared_ptr<const void> owner) {
  SharedLink& l = link(peer);
  auto& s = *l.state_;
  SharedLink::State::Out o{s.next_send++, {}, static_cast<const char*>(data),
                           bytes,         0,  std::move(owner)};
  const uint64_t length = bytes;
  std::memcpy(o.header, &tag, sizeof(tag));
  std::memcpy(o.header + 8, &length, sizeof(length));
  const uint64_t ticket = o.ticket;
  s.out.push_back(std::move(o));
  l.pump();
  return ticket;
}

bool LinkSet::sent(int peer, uint64_t ticket) {
  pump_all();
  return ticket < link(peer).state_->sent_below;
}

void LinkSet::wait_sent(int peer, uint64_t ticket, const std::string& what) {
  SharedLink& l = link(peer);
  wait(
      peer, [&] { return ticket < l.state_->sent_below; }, what);
}

uint64_t LinkSet::post(int peer, int32_t tag, void* data, size_t bytes) {
  SharedLink& l = link(peer);
  auto& s = *l.state_;
  const uint64_t ticket = s.next_recv++;
  auto held = s.held.find(tag);
  if (held != s.held.end() && !held->second.empty()) {
    std::vector<char> m = std::move(held->second.front());
    held->second.pop_front();
    if (m.size() != bytes) l.wrong_length(bytes, tag, m.size());
    std::memcpy(data, m.data(), bytes);
    s.completed.insert(ticket);
    return ticket;
  }
  if (s.header_got == kHeader && s.dest_ticket == 0 && s.tag == tag) {
    // Its message is being read into a held copy: the rest goes straight to `data`.
    if (s.length != bytes) l.wrong_length(bytes);
    std::memcpy(data, s.holding.data(), s.got);
    s.holding = {};
    s.dest = static_cast<char*>(data);
    s.dest_ticket = ticket;
  } else {
    s.posted[tag].push_back({ticket, static_cast<char*>(data), bytes});
  }
  l.pump();
  return ticket;
}

bool LinkSet::received(int peer, uint64_t ticket) {
  pump_all();
  return link(peer).state_->completed.count(ticket) != 0;
}

void LinkSet::wait_received(int peer, uint64_t ticket, const std::string& what) {
  SharedLink& l = link(peer);
  auto& c = l.state_->completed;
  wait(
      peer, [&] { return c.count(ticket) != 0; }, what);
  c.erase(ticket);
}

void LinkSet::withdraw(int peer, uint64_t ticket) {
  SharedLink& l = link(peer);
  auto& s = *l.state_;
  if (s.completed.erase(ticket) != 0) return;
  for (auto& p : s.posted) {
    for (auto it = p.second.begin(); it != p.second.end(); ++it) {
      if (it->ticket == ticket) {
        p.second.erase(it);
        return;
      }
    }
  }
  if (s.dest_ticket == ticket) {  // being read: the rest is passed over
    s.dest = nullptr;
    s.dest_ticket = kDrop;
  }
}

}  // namespace scaletrain
