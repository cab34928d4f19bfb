// The lighthouse (fault_tolerance.h): the process or thread that forms the replicas' quorums.
// It owns the store the replicas talk through (StoreServer: only processes that prove the job's
// secret get in) and reads its keys in process. Its keys and rules are in Note [Replica groups]
// (fault_tolerance.cpp).

#include <algorithm>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "dist/store_server.h"
#include "scaletrain/error.h"
#include "scaletrain/fault_tolerance.h"
#include "scaletrain/secret.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// "ft/<what>/<replica>/<nonce>" → (replica, nonce); false for anything else.
bool parse_process_key(const std::string& key, const std::string& what, int* replica,
                       std::string* nonce) {
  const std::string prefix = "ft/" + what + "/";
  if (key.compare(0, prefix.size(), prefix) != 0) return false;
  const auto slash = key.find('/', prefix.size());
  if (slash == std::string::npos) return false;
  try {
    size_t used = 0;
    *replica = std::stoi(key.substr(prefix.size(), slash - prefix.size()), &used);
    if (used != slash - prefix.size() || *replica < 0) return false;
  } catch (const std::exception&) {
    return false;
  }
  *nonce = key.substr(slash + 1);
  return !nonce->empty();
}

class Lighthouse {
 public:
  Lighthouse(const LighthouseOptions& o, StoreServer& store) : o_(o), store_(store) {}

  // One look at the store; forms a quorum where one is due. Returns whether it did anything.
  bool poll() {
    const auto now = Clock::now();
    discover(now);
    settle_owners(now);
    read_done();
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
  // One process that registered as a replica (rank 0 of it).
  struct Process {
    int replica = 0;
    std::string nonce, where;         // where: "host pid"
    std::optional<std::string> beat;  // its beat key's value: any change is a beat
    Clock::time_point seen, registered;
    std::string answered;  // the token of the last answer
    std::string refusal;   // set: every request of it is answered so, and nothing else
    bool left = false;     // it said goodbye (its registration is gone)
  };
  struct Ask {
    std::string token;
    int64_t step = 0;
    bool fresh_group = false;
  };

  static std::string id(int r, const std::string& nonce) { return std::to_string(r) + "/" + nonce; }
  Process* owner_of(int r) {
    auto o = owner_.find(r);
    return o == owner_.end() ? nullptr : &procs_.at(o->second);
  }
  bool alive(const Process& p, Clock::time_point now) const {
    return !p.left && now - p.seen < o_.heartbeat_timeout;
  }
  bool alive(int r, Clock::time_point now) {
    const Process* p = owner_of(r);
    return p != nullptr && alive(*p, now);
  }

  void discover(Clock::time_point now) {
    int r = 0;
    std::string nonce;
    for (const auto& key : store_.keys("ft/reg/")) {
      if (!parse_process_key(key, "reg", &r, &nonce) || procs_.count(id(r, nonce))) continue;
      Process p;
      p.replica = r;
      p.nonce = nonce;
      p.where = store_.get(key).value_or("?");
      p.seen = p.registered = now;
      procs_.emplace(id(r, nonce), p);
      if (owner_.count(r) == 0) owner_[r] = id(r, nonce);
    }
    for (auto& [key, p] : procs_) {
      if (!store_.get("ft/reg/" + key)) {  // it left (ReplicaGroup's destructor): gone now
        p.left = true;
        continue;
      }
      // Compared, not parsed: a value that is no number (a bug in a process of the job) must
      // not throw out of the lighthouse (regression AMalformedBeatStoppedTheLighthouse).
      auto beat = store_.get("ft/beat/" + key);
      if (beat != p.beat) p.beat = std::move(beat), p.seen = now;
    }
  }

  // Note [One process per replica id]: a replica's new process (a restart) takes the id over
  // once the old one's beats have stopped; a second live process with the id is refused by name
  // once the old one has beaten on for twice the heartbeat timeout after it came.
  void settle_owners(Clock::time_point now) {
    std::vector<std::string> gone;
    for (auto& [key, p] : procs_) {
      if (!p.refusal.empty() || owner_.at(p.replica) == key) continue;
      const std::string holder = owner_.at(p.replica);
      if (!alive(procs_.at(holder), now)) {
        gone.push_back(holder);
        owner_[p.replica] = key;
        pending_.erase(p.replica);  // the dead one's ask
      } else if (now - p.registered > 2 * o_.heartbeat_timeout) {
        p.refusal = "duplicate " + procs_.at(holder).where;
      }
    }
    for (const auto& key : gone) retire(key);
  }

  // A dead process's keys go, and the process with them: the store does not grow with restarts.
  void retire(const std::string& key) {
    for (const char* what : {"ft/reg/", "ft/beat/", "ft/req/", "ft/done/"}) {
      store_.erase(what + key);
    }
    procs_.erase(key);
  }

  // A replica that finished says so (ReplicaGroup::finished); only a member of the last quorum,
  // at a step it could have reached, ends the run.
  void read_done() {
    int r = 0;
    std::string nonce;
    for (const auto& key : store_.keys("ft/done/")) {
      if (!parse_process_key(key, "done", &r, &nonce)) continue;
      const auto value = store_.get(key);
      int64_t step = -1;
      try {
        step = value ? std::stoll(*value) : -1;
      } catch (const std::exception&) {
      }
      const bool member = std::find(members_.begin(), members_.end(), r) != members_.end();
      const bool owner = owner_.count(r) && owner_.at(r) == id(r, nonce);
      if (member && owner && step >= 0 && step <= last_max_ + 1) done_ = std::max(done_, step);
    }
  }

  void read_requests(Clock::time_point now) {
    for (auto& [key, p] : procs_) {
      const auto req = store_.get("ft/req/" + key);
      if (!req) continue;
      std::istringstream in(*req);
      Ask a;
      int fresh = 0;
      std::string fingerprint;
      in >> a.token >> a.step >> fresh >> fingerprint;
      a.fresh_group = fresh != 0;
      if (a.token.empty() || a.token == p.answered) continue;
      if (!p.refusal.empty()) {
        answer(p, a.token, "refused-" + p.refusal);
        continue;
      }
      if (owner_.at(p.replica) != key) continue;  // waits for the id (settle_owners)
      auto pending = pending_.find(p.replica);
      if (pending != pending_.end() && pending->second.token == a.token) continue;
      p.seen = now;  // it asked: it lives
      if (job_.empty()) job_ = fingerprint;
      if (fingerprint != job_) {  // another job's settings: the replica stops, naming both
        answer(p, a.token, "refused " + job_);
        continue;
      }
      // No honest replica is ahead of the job: its checkpoints are of steps a quorum formed.
      if (!members_.empty() && a.step > last_max_ + 1) {
        answer(p, a.token, "refused-step " + std::to_string(last_max_));
        continue;
      }
      if (pending_.empty()) first_ask_ = now;
      pending_[p.replica] = a;
    }
  }

  void answer(Process& p, const std::string& token, const std::string& what) {
    store_.set("ft/ans/" + token, what);
    p.answered = token;
  }

  // The run ended at step done_: a replica behind has no peer left to heal it.
  void answer_the_late() {
    if (done_ < 0) return;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.step >= done_) {
        ++it;
        continue;
      }
      answer(*owner_of(it->first), it->second.token, "done " + std::to_string(done_));
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
    for (int r : members) answer(*owner_of(r), pending_[r].token, out.str());
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
  StoreServer& store_;
  std::map<std::string, Process> procs_;  // by "<replica>/<nonce>"
  std::map<int, std::string> owner_;      // replica id -> the process that holds it
  int64_t done_ = -1;                     // the step the run ended at
  std::string job_;                       // the job's settings (the first request's)
  int64_t last_max_ = -1;                 // the last quorum's step
  std::map<int, Ask> pending_;
  Clock::time_point first_ask_;
  std::vector<int> members_;
  int64_t id_ = 0;
};

std::string lighthouse_secret(const LighthouseOptions& o) {
  std::string secret = o.secret.empty() ? user_secret() : o.secret;
  if (secret.empty()) {
    throw UsageError(
        "the lighthouse needs the job's secret, which every replica proves before it is heard: "
        "set SCALETRAIN_SECRET_FILE=PATH (a file only you may read; made with a new secret where "
        "missing) for the lighthouse and every replica's launcher, or SCALETRAIN_SECRET "
        "(LighthouseOptions::secret in a program; docs/resilience.md)");
  }
  if (secret.size() < kMinSecretLength) {
    throw UsageError("LighthouseOptions::secret holds " + std::to_string(secret.size()) +
                     " characters, fewer than " + std::to_string(kMinSecretLength));
  }
  return secret;
}

}  // namespace

void serve_lighthouse(const LighthouseOptions& options, const std::atomic<bool>* stop) {
  if (options.min_replicas < 1) {
    throw UsageError("the lighthouse's minimum of replicas " +
                     std::to_string(options.min_replicas) + " must be at least 1");
  }
  StoreServerOptions so;
  so.host = options.host;
  so.port = options.port;
  so.secret = lighthouse_secret(options);
  so.service = "lighthouse";
  so.log = options.on_refused;
  std::unique_ptr<StoreServer> store;
  try {
    store = std::make_unique<StoreServer>(so);
  } catch (const Error& e) {
    throw Error("the lighthouse " + std::string(e.what()) +
                "\nThe port may be taken: choose another --port (0: a free one); --host must be "
                "an address of this machine.");
  }
  if (options.on_listening) options.on_listening(store->port());
  Lighthouse lighthouse(options, *store);
  // A change of any key wakes the loop (an ask, a beat, a registration); it looks every 25 ms
  // anyway, for the timeouts.
  while (stop == nullptr || !stop->load()) {
    const uint64_t seen = store->changes();
    if (lighthouse.poll()) continue;
    store->wait_for_change(seen, milliseconds(25));
  }
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

}  // namespace scaletrain
