// The lighthouse (fault_tolerance.h): the process or thread that forms the replicas' quorums
// over a c10d TCPStore. Its keys and rules are in Note [Replica groups] (fault_tolerance.cpp).

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "dist/lighthouse_client.h"
#include "dist/text.h"
#include "scaletrain/error.h"
#include "scaletrain/fault_tolerance.h"

namespace scaletrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using dist_text::bytes;
using dist_text::seconds;
using dist_text::text;

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
      client = lighthouse_client(host, port, std::chrono::seconds(60));
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

}  // namespace scaletrain
