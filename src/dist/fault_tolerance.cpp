// Fault-tolerant replicas (fault_tolerance.h).
//
// Note [Replica groups]: TorchFT's design, small. Each replica is a job of its own: its own
// launcher, world, store and restarts. The lighthouse is a process outside every replica that
// serves a TCP store and watches it:
//
//   ft/nreg, ft/reg/<i>   replicas announce themselves (rank 0 of each, at its start)
//   ft/beat/<r>           rank 0 of replica r adds 1 every beat_interval, from a thread
//   ft/req/<r>            "<token> <step> <new> <settings>": replica r asks for the quorum of
//                         its next step (token: a nonce of the process and a count)
//   ft/nask, ft/ask/<n>   each request also counts itself and sets its key, which wakes the
//                         lighthouse (a thread of it blocks on the next key)
//   ft/ans/<token>        the answer, deleted once read: "<id> <max_step> <donor> <n> r0 s0 ...",
//                         "done <step>" or "refused <the job's settings>"
//   ft/done               the step the run ended at (the first replica to finish sets it)
//
// A quorum forms from the live replicas that asked, at least min_replicas of them, once every
// member of the previous quorum that still beats has asked, or join_timeout after the first ask
// (the first quorum waits that long unless LighthouseOptions::replicas have asked). One rule
// keeps two quorums from training the same step apart: while a live member of the last quorum
// has not asked, a quorum at or below the last one's step is not formed at all (that member may
// have committed the step; it is waited for until it asks or its beats stop). Its id changes
// when the membership does, or when a replica asks for a new group after a failed step; then the
// replicas' rank k processes make a Gloo group of their own under ft/q<id>/k<k>/ in the same
// store. A step is committed only when every exchange of every rank of the replica succeeded
// (commit(), and share_state() agrees the same way); a replica that committed while another did
// not is simply ahead, and the next quorum heals the other: the furthest replica (the donor)
// sends its state to the ones behind (share_state()), over the same groups. So a replica that
// dies is left out at the next step boundary (its peers' exchange with it fails at once, and its
// beats stop), and one that comes back asks with the step of its checkpoint (or 0) and is healed
// before its first step. A replica asking with other settings (seed, batch, data, epochs, ranks)
// is refused by name. A replica behind once the run has ended (ft/done) is told so and stops
// instead of training the rest alone.
//
// What it does not survive: the lighthouse's own death (every replica's quorum() fails within
// quorum_timeout, naming it, and the launchers' restarts fail the same way).

#include "scaletrain/fault_tolerance.h"

#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "dist/text.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using dist_text::bytes;
using dist_text::seconds;
using dist_text::text;

c10::intrusive_ptr<c10d::TCPStore> store_client(const std::string& host, int port,
                                                milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    throw Error("the lighthouse at " + host + ":" + std::to_string(port) +
                " cannot be reached within " + seconds(timeout) + ": " + e.what() +
                "\nStart it first (scaletrain lighthouse --port " + std::to_string(port) +
                ") and give its host and port to every replica (--lighthouse HOST:PORT).");
  }
}

// The lighthouse's bookkeeping (Note [Replica groups]).
class Lighthouse {
 public:
  Lighthouse(const LighthouseOptions& o, c10d::Store& store) : o_(o), store_(store) {}

  // One look at the store; forms a quorum where one is due. Returns whether it did anything.
  bool poll() {
    const auto now = Clock::now();
    if (now - looked_ >= milliseconds(25)) {  // beats and newcomers: every 25 ms is enough
      looked_ = now;
      discover(now);
      if (done_ < 0 && store_.check({"ft/done"})) done_ = std::stoll(text(store_.get("ft/done")));
    }
    read_requests(now);
    answer_the_late();
    for (auto it = pending_.begin(); it != pending_.end();) {  // asked, then died
      it = alive(it->first, now) ? std::next(it) : pending_.erase(it);
    }
    if (pending_.empty() || static_cast<int>(pending_.size()) < o_.min_replicas) return false;
    bool waiting = false;
    int64_t max_step = 0;
    for (const auto& [r, a] : pending_) max_step = std::max(max_step, a.step);
    for (int r : members_) {
      if (pending_.count(r) == 0 && alive(r, now)) waiting = true;
    }
    // The first quorum waits the join timeout out (or for LighthouseOptions::replicas): the
    // replicas start at about the same time, and one still loading has not announced itself.
    if (members_.empty()) {
      const bool all_asked = o_.replicas > 0 && static_cast<int>(pending_.size()) >= o_.replicas;
      waiting = waiting || !all_asked;
    }
    if (waiting && now - first_ask_ < o_.join_timeout) return false;
    // Never two quorums at one step: while a live member of the last quorum, which may have
    // committed it, has not asked, the ones at or below its step wait for it (or for its death).
    if (waiting && !members_.empty() && max_step <= last_max_) return false;
    form(max_step);
    return true;
  }

 private:
  struct Known {
    int64_t beat = -1;
    Clock::time_point seen;
    std::string answered;  // the token of the last answer
  };
  struct Ask {
    std::string token;
    int64_t step = 0;
    bool fresh_group = false;
  };

  bool alive(int r, Clock::time_point now) const {
    auto it = known_.find(r);
    return it != known_.end() && now - it->second.seen < o_.heartbeat_timeout;
  }

  void discover(Clock::time_point now) {
    const int64_t n = store_.add("ft/nreg", 0);
    for (int64_t i = registered_; i < n; ++i) {
      const std::string key = "ft/reg/" + std::to_string(i);
      if (named_.count(i) || !store_.check({key})) continue;  // its name may be on the way
      named_.insert(i);
      known_[std::stoi(text(store_.get(key)))].seen = now;
    }
    while (named_.count(registered_)) named_.erase(registered_++);
    for (auto& [r, k] : known_) {
      const int64_t beat = store_.add("ft/beat/" + std::to_string(r), 0);
      if (beat != k.beat) k.beat = beat, k.seen = now;
    }
  }

  void read_requests(Clock::time_point now) {
    for (auto& [r, k] : known_) {
      const std::string key = "ft/req/" + std::to_string(r);
      if (!store_.check({key})) continue;
      std::istringstream in(text(store_.get(key)));
      Ask a;
      int fresh = 0;
      std::string fingerprint;
      in >> a.token >> a.step >> fresh >> fingerprint;
      a.fresh_group = fresh != 0;
      if (a.token == k.answered) continue;
      auto p = pending_.find(r);
      if (p != pending_.end() && p->second.token == a.token) continue;
      k.seen = now;  // it asked: it lives
      if (job_.empty()) job_ = fingerprint;
      if (fingerprint != job_) {  // another job's settings: the replica stops, naming both
        answer(r, a.token, "refused " + job_);
        continue;
      }
      if (pending_.empty()) first_ask_ = now;
      pending_[r] = a;
    }
  }

  void answer(int r, const std::string& token, const std::string& what) {
    store_.set("ft/ans/" + token, bytes(what));
    known_[r].answered = token;
  }

  // The run ended at step done_: a replica behind has no peer left to heal it.
  void answer_the_late() {
    if (done_ < 0) return;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.step >= done_) {
        ++it;
        continue;
      }
      answer(it->first, it->second.token, "done " + std::to_string(done_));
      it = pending_.erase(it);
    }
  }

  void form(int64_t max_step) {
    std::vector<int> members;
    bool fresh = false;
    for (const auto& [r, a] : pending_) {
      members.push_back(r);
      fresh = fresh || a.fresh_group;
    }
    const bool changed = members != members_ || fresh;
    if (changed) ++id_;
    // The donor: a replica at the furthest step, one of the previous quorum where there is one.
    int donor = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      const int r = members[i];
      if (pending_[r].step != max_step) continue;
      const bool old = std::find(members_.begin(), members_.end(), r) != members_.end();
      if (donor < 0 || (old && std::find(members_.begin(), members_.end(),
                                         members[static_cast<size_t>(donor)]) == members_.end())) {
        donor = static_cast<int>(i);
      }
    }
    std::ostringstream out;
    out << id_ << " " << max_step << " " << donor << " " << members.size();
    for (int r : members) out << " " << r << " " << pending_[r].step;
    for (int r : members) answer(r, pending_[r].token, out.str());
    if (changed && o_.on_quorum) o_.on_quorum(describe(members, max_step, donor));
    members_ = members;
    last_max_ = max_step;
    pending_.clear();
  }

  std::string describe(const std::vector<int>& members, int64_t max_step, int donor) {
    std::ostringstream s;
    s << "quorum " << id_ << " at step " << max_step << ": replica"
      << (members.size() > 1 ? "s" : "");
    for (size_t i = 0; i < members.size(); ++i) s << (i ? ", " : " ") << members[i];
    for (int r : members_) {
      if (std::find(members.begin(), members.end(), r) == members.end()) s << "; " << r << " left";
    }
    for (int r : members) {
      if (pending_[r].step < max_step) {
        s << "; " << r << " (at step " << pending_[r].step << ") takes the state of "
          << members[static_cast<size_t>(donor)];
      }
    }
    return s.str();
  }

  const LighthouseOptions o_;
  c10d::Store& store_;
  int64_t registered_ = 0;    // registrations read up to here
  std::set<int64_t> named_;   // read beyond it (a replica killed before naming itself leaves a gap)
  Clock::time_point looked_;  // the last look at beats and registrations
  int64_t done_ = -1;         // the step the run ended at (ft/done)
  std::string job_;           // the job's settings (the first request's fingerprint)
  int64_t last_max_ = -1;     // the last quorum's step
  std::map<int, Known> known_;
  std::map<int, Ask> pending_;
  Clock::time_point first_ask_;
  std::vector<int> members_;
  int64_t id_ = 0;
};

// A string from rank 0 of `d` on each of its ranks (through the device NCCL needs).

// The lighthouse's wake-up on asks (serve_lighthouse): a replica asking adds to ft/nask and sets
// ft/ask/<its count>; this waits for each in turn on a connection of its own.
struct AskWaker {
  std::mutex mu;
  std::condition_variable cv;
  bool woken = false;
  std::atomic<int64_t> next{1};
  std::atomic<bool> stop{false};

  void run(const std::string& host, int port) {
    c10::intrusive_ptr<c10d::TCPStore> client;
    try {
      client = store_client(host, port, std::chrono::seconds(60));
    } catch (const std::exception&) {
      return;  // the loop still looks every 20 ms
    }
    while (!stop) {
      const std::string key = "ft/ask/" + std::to_string(next.load());
      try {
        client->wait({key}, std::chrono::seconds(60));
        client->deleteKey(key);
        ++next;
      } catch (const std::exception&) {
        if (stop) break;
        try {  // a replica killed between its count and its key: that key never comes
          if (client->add("ft/nask", 0) >= next) ++next;
        } catch (const std::exception&) {
          return;
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        woken = true;
      }
      cv.notify_all();
    }
  }
};

}  // namespace

std::pair<std::string, int> parse_host_port(const std::string& value, const std::string& what) {
  const auto colon = value.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    try {
      size_t used = 0;
      port = std::stoi(value.substr(colon + 1), &used);
      if (used != value.size() - colon - 1) port = -1;
    } catch (const std::exception&) {
      port = -1;
    }
  }
  if (port < 1 || port > 65535) {
    throw UsageError(what + " '" + value + "' is not HOST:PORT (e.g. 127.0.0.1:29510)");
  }
  return {value.substr(0, colon), port};
}

void serve_lighthouse(const LighthouseOptions& options, const std::atomic<bool>* stop) {
  if (options.min_replicas < 1) {
    throw UsageError("the lighthouse's minimum of replicas " +
                     std::to_string(options.min_replicas) + " must be at least 1");
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(options.port);
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = milliseconds(30000);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.host, so);
  } catch (const std::exception& e) {
    throw Error("the lighthouse cannot listen on " + options.host + ":" +
                std::to_string(options.port) + ": " + e.what() +
                "\nThe port may be taken: choose another --port (0: a free one).");
  }
  const int port = static_cast<int>(store->getPort());
  if (options.on_listening) options.on_listening(port);
  Lighthouse lighthouse(options, *store);
  // A thread blocks on the next ask's key (ft/ask/<n>) and wakes the loop the moment one comes;
  // the loop looks at the store at least every 20 ms anyway (beats, timeouts).
  auto waker = std::make_shared<AskWaker>();
  const std::string self = options.host == "0.0.0.0" ? "127.0.0.1" : options.host;
  std::thread waiter([waker, self, port] { waker->run(self, port); });
  while (stop == nullptr || !stop->load()) {
    if (lighthouse.poll()) continue;
    std::unique_lock<std::mutex> lock(waker->mu);
    waker->cv.wait_for(lock, milliseconds(20), [&] { return waker->woken; });
    waker->woken = false;
  }
  waker->stop = true;
  store->set("ft/ask/" + std::to_string(waker->next.load()), bytes(""));  // wakes the waiter
  waiter.join();
}

LighthouseThread::LighthouseThread(LighthouseOptions options) : host_(options.host) {
  auto listening = std::make_shared<std::promise<int>>();
  auto told = std::make_shared<std::atomic<bool>>(false);
  options.on_listening = [listening, told](int port) {
    if (!told->exchange(true)) listening->set_value(port);
  };
  thread_ = std::thread([this, options, listening, told] {
    try {
      serve_lighthouse(options, &stop_);
    } catch (...) {
      if (!told->exchange(true)) listening->set_exception(std::current_exception());
    }
  });
  try {
    port_ = listening->get_future().get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

LighthouseThread::~LighthouseThread() {
  stop_ = true;
  thread_.join();
}

std::string LighthouseThread::address() const {
  return (host_ == "0.0.0.0" || host_.empty() ? "127.0.0.1" : host_) + ":" + std::to_string(port_);
}

struct ReplicaGroup::Impl {
  Dist replica;
  std::string host;
  int port = 0;
  c10::intrusive_ptr<c10d::TCPStore> store;  // the lighthouse's
  std::optional<Dist> group;                 // rank k of each replica in the quorum
  Quorum quorum;
  int64_t group_id = -1;
  bool broken = false;       // an exchange of this step failed
  bool fresh_group = false;  // ask for a new group: the last step was not committed
  int64_t asked = 0;
  std::string nonce;        // this process's requests' (answers are keyed by it)
  std::string fingerprint;  // the settings every replica of the job shares
  std::thread beater;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;

  // Rank 0's beats, on a connection of their own. A failed beat (the lighthouse busy or briefly
  // out of reach) connects again on the next one; quorum() reports a lighthouse that is gone.
  void beat(int replica_id, milliseconds every) {
    c10::intrusive_ptr<c10d::TCPStore> own;
    const std::string key = "ft/beat/" + std::to_string(replica_id);
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      lock.unlock();
      try {
        if (!own) own = store_client(host, port, milliseconds(2000));
        own->add(key, 1);
      } catch (const std::exception&) {
        own.reset();
      }
      lock.lock();
      cv.wait_for(lock, every, [this] { return stopping; });
    }
  }

  // Collective over the replica: whether `mine` holds on every rank; a false one asks the next
  // quorum for a new group.
  bool agree(bool mine) {
    bool ok = mine && !broken;
    if (replica.size() > 1) {
      const at::Device dev =
          replica.backend_name == "nccl" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
      auto failed = at::tensor({ok ? 0 : 1}, at::kInt).to(dev);
      replica.all_reduce(failed, ReduceOp::SUM, "the replica's agreement on its exchanges");
      ok = failed.cpu().item<int>() == 0;
    }
    if (!ok) fresh_group = true;
    broken = false;
    return ok;
  }

  void make_group(const ReplicaGroupOptions& o) {
    group.reset();
    group_id = quorum.id;
    broken = false;
    if (quorum.size() < 2) return;
    Dist g;
    g.world = replica.world;
    g.world.rank = quorum.slot;
    g.world.world_size = quorum.size();
    g.world.master_addr = host;
    g.world.master_port = port;
    g.backend_name = "gloo";
    g.store = store;
    g.timeout = o.timeout;
    try {
      g.backend = new_backend(
          g, "gloo",
          "ft/q" + std::to_string(quorum.id) + "/k" + std::to_string(replica.rank()) + "/",
          o.timeout);
      group = std::move(g);
    } catch (const std::exception&) {
      broken = true;  // a member left while the group was made: this step is not committed
    }
  }
};

ReplicaGroup::ReplicaGroup(const Dist& replica, ReplicaGroupOptions options)
    : impl_(std::make_unique<Impl>()), options_(std::move(options)) {
  require_joined(replica, "ReplicaGroup");
  if (options_.replica_id < 0) {
    throw UsageError("replica id " + std::to_string(options_.replica_id) + " must be 0 or more");
  }
  auto [host, port] = parse_host_port(options_.lighthouse, "the lighthouse");
  impl_->replica = replica;
  impl_->host = host;
  impl_->port = port;
  impl_->store = store_client(host, port, options_.quorum_timeout);
  std::random_device device;
  std::ostringstream nonce;
  nonce << std::hex << device() << device() << "-r" << options_.replica_id;
  impl_->nonce = nonce.str();
  impl_->fingerprint = options_.fingerprint + "|ranks=" + std::to_string(replica.size());
  for (char& c : impl_->fingerprint) c = c == ' ' ? '_' : c;
  if (replica.rank() == 0) {
    const int64_t i = impl_->store->add("ft/nreg", 1) - 1;
    impl_->store->set("ft/reg/" + std::to_string(i), bytes(std::to_string(options_.replica_id)));
    impl_->beater =
        std::thread([this] { impl_->beat(options_.replica_id, options_.beat_interval); });
  }
}

ReplicaGroup::~ReplicaGroup() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->beater.joinable()) impl_->beater.join();
}

Quorum ReplicaGroup::quorum(int64_t step) {
  auto& m = *impl_;
  std::string answer;
  if (m.replica.rank() == 0 && m.store->check({"ft/done"})) {
    const std::string done = text(m.store->get("ft/done"));
    if (std::stoll(done) > step) answer = "done " + done;
  }
  if (m.replica.rank() == 0 && answer.empty()) {
    const std::string token = m.nonce + "-" + std::to_string(++m.asked);
    m.store->set("ft/req/" + std::to_string(options_.replica_id),
                 bytes(token + " " + std::to_string(step) + " " + (m.fresh_group ? "1" : "0") +
                       " " + m.fingerprint));
    const int64_t ask = m.store->add("ft/nask", 1);  // wakes the lighthouse (AskWaker)
    m.store->set("ft/ask/" + std::to_string(ask), bytes(""));
    try {
      m.store->wait({"ft/ans/" + token}, options_.quorum_timeout);
      answer = text(m.store->get("ft/ans/" + token));
      m.store->deleteKey("ft/ans/" + token);  // the lighthouse's store does not grow by a step
    } catch (const std::exception& e) {
      throw Error(
          "replica " + std::to_string(options_.replica_id) + ": the lighthouse at " +
          options_.lighthouse + " gave no quorum within " + seconds(options_.quorum_timeout) +
          " (it is gone, or fewer replicas than its --min-replicas are alive): " + e.what());
    }
  }
  answer = dist_text::broadcast_text(m.replica, answer, "the quorum");
  Quorum q;
  if (answer.rfind("refused ", 0) == 0) {
    throw UsageError("replica " + std::to_string(options_.replica_id) +
                     ": the lighthouse's job trains with other settings (" + answer.substr(8) +
                     ") than this replica (" + m.fingerprint +
                     "); every replica of a job needs the same ones, or give it a lighthouse of "
                     "its own");
  }
  if (answer.rfind("done ", 0) == 0) {
    q.finished_at = std::stoll(answer.substr(5));
    q.replicas = {options_.replica_id};
    q.steps = {step};
    q.max_step = step;
    return q;
  }
  std::istringstream in(answer);
  int64_t n = 0;
  in >> q.id >> q.max_step >> q.donor >> n;
  q.slot = -1;
  for (int64_t i = 0; i < n; ++i) {
    int r = 0;
    int64_t s = 0;
    in >> r >> s;
    if (r == options_.replica_id) q.slot = static_cast<int>(i);
    q.replicas.push_back(r);
    q.steps.push_back(s);
    q.heal = q.heal || s != q.max_step;
  }
  if (!in || q.slot < 0) {
    throw Error("replica " + std::to_string(options_.replica_id) + ": the lighthouse's answer '" +
                answer + "' is not a quorum with this replica");
  }
  q.recovering = q.steps[static_cast<size_t>(q.slot)] < q.max_step;
  m.quorum = q;
  if (q.id != m.group_id || m.fresh_group) m.make_group(options_);
  m.fresh_group = false;
  return q;
}

bool ReplicaGroup::share_state(const std::function<at::Tensor()>& mine, at::Tensor* received) {
  auto& m = *impl_;
  bool ok = !m.broken;
  at::Tensor data;
  if (ok && m.group) {
    const bool donor = m.quorum.slot == m.quorum.donor;
    try {
      data = donor ? mine().to(at::kByte).contiguous() : at::Tensor();
      auto n = at::tensor({donor ? data.numel() : int64_t{0}}, at::kLong);
      m.group->broadcast(n, m.quorum.donor, "the size of the donor's state");
      if (!donor) data = at::empty({n.item<int64_t>()}, at::kByte);
      m.group->broadcast(data, m.quorum.donor, "the donor's state");
    } catch (const std::exception&) {
      ok = false;
    }
  }
  // Every rank of the replica takes it, or none does (a rank whose transfer failed would
  // otherwise meet its peers in other collectives).
  ok = m.agree(ok);
  if (ok && m.quorum.recovering && received != nullptr) *received = data;
  return ok;
}

bool ReplicaGroup::all_reduce(at::Tensor& tensor) {
  auto& m = *impl_;
  if (m.broken) return false;
  if (!m.group) return true;
  try {
    m.group->all_reduce(tensor, ReduceOp::SUM, "the sum over the replicas");
    return true;
  } catch (const std::exception&) {
    m.broken = true;
    return false;
  }
}

bool ReplicaGroup::commit(bool mine) { return impl_->agree(mine); }

void ReplicaGroup::finished(int64_t step) {
  if (impl_->replica.rank() == 0) impl_->store->set("ft/done", bytes(std::to_string(step)));
}

int ReplicaGroup::live() const { return std::max(impl_->quorum.size(), 1); }

}  // namespace scaletrain
