// Fault-tolerant replicas (fault_tolerance.h).
//
// Note [Replica groups]: TorchFT's design, small. Each replica is a job of its own: its own
// launcher, world, store and restarts. The lighthouse is a process outside every replica that
// serves a store (StoreServer: a connection proves the job's secret before anything it says is
// read, Note [Authenticated connections]) and watches its keys; <r>/<n> below is replica r's
// process with nonce n (rank 0 of the replica, a fresh nonce per process):
//
//   ft/reg/<r>/<n>        "<host> pid <pid>": the process announces itself, at its start
//   ft/beat/<r>/<n>       it adds 1 every beat_interval, from a thread
//   ft/req/<r>/<n>        "<token> <step> <new> <settings>": it asks for the quorum of its next
//                         step (token: the nonce and a count)
//   ft/ans/<token>        the answer, deleted once read: "<id> <max_step> <donor> <n> r0 s0 ...",
//                         "done <step>", or a refusal: "refused <the job's settings>",
//                         "refused-duplicate <host pid>", "refused-step <the job's step>"
//   ft/done/<r>/<n>       the step the run ended at, said by a replica that finished
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
// before its first step.
//
// What the lighthouse believes of what it is told: one process per replica id (Note [One
// process per replica id] in lighthouse.cpp: a restart takes the id over once the old process's
// beats stopped; a second live process is refused by name); a replica asking with other
// settings is refused, and its error names each setting that differs; no replica asks ahead of
// the job (a step past the last quorum's + 1 is refused: an honest replica's checkpoint is of a
// step a quorum formed), so none becomes the donor by claiming a step; only the process that
// holds a member's id of the last quorum ends the run (ft/done), at a step the job reached. A
// replica behind once the run has ended is told so and stops instead of training the rest alone.
//
// What it does not survive: the lighthouse's own death (every replica's quorum() fails at once,
// naming it and its address, and the launchers' restarts fail the same way).

#include "scaletrain/fault_tolerance.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "dist/auth_store.h"
#include "dist/lighthouse_client.h"
#include "dist/text.h"
#include "scaletrain/error.h"
#include "scaletrain/secret.h"

namespace scaletrain {
namespace {

using std::chrono::milliseconds;

using dist_text::bytes;
using dist_text::seconds;
using dist_text::text;

}  // namespace

c10::intrusive_ptr<AuthStore> lighthouse_client(const std::string& host, int port,
                                                const std::string& secret, milliseconds timeout) {
  AuthStoreOptions o;
  o.host = host;
  o.port = port;
  o.secret = secret;
  o.service = "lighthouse";
  o.what = "the lighthouse";
  o.timeout = timeout;
  try {
    return c10::make_intrusive<AuthStore>(o);
  } catch (const c10::Error& e) {
    throw Error(std::string(e.what_without_backtrace()) +
                ": start it first (scaletrain lighthouse --port " + std::to_string(port) +
                ") and give its address to every replica (ReplicaGroupOptions::lighthouse "
                "HOST:PORT)");
  }
}

namespace {

// Each setting of `mine` that differs from `job`'s ("name=value|name=value"), in words.
std::string differences(const std::string& job, const std::string& mine) {
  auto split = [](const std::string& s) {
    std::map<std::string, std::string> out;
    std::istringstream in(s);
    for (std::string item; std::getline(in, item, '|');) {
      const auto eq = item.find('=');
      out[item.substr(0, eq)] = eq == std::string::npos ? "" : item.substr(eq + 1);
    }
    return out;
  };
  const auto a = split(job), b = split(mine);
  std::string out;
  for (const auto& [k, v] : b) {
    auto it = a.find(k);
    const std::string theirs = it == a.end() ? "(none)" : it->second;
    if (theirs != v)
      out += (out.empty() ? "" : "; ") + k + " " + v + " here, " + theirs + " in the job";
  }
  for (const auto& [k, v] : a) {
    if (b.count(k) == 0)
      out += (out.empty() ? "" : "; ") + k + " (none) here, " + v + " in the job";
  }
  return out;
}

std::string this_process() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0')
    return "? pid " + std::to_string(getpid());
  for (char* c = name; *c != '\0'; ++c) {
    if (*c == ' ') *c = '_';
  }
  return std::string(name) + " pid " + std::to_string(getpid());
}

}  // namespace

// The lighthouse's bookkeeping (Note [Replica groups]).

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

struct ReplicaGroup::Impl {
  Dist replica;
  std::string host;
  int port = 0;
  c10::intrusive_ptr<AuthStore> store;  // the lighthouse's
  std::string secret;
  std::optional<Dist> group;  // rank k of each replica in the quorum
  Quorum quorum;
  int64_t group_id = -1;
  bool broken = false;  // an exchange of this step failed
  // Ask for a new group: the last step was not committed, or this process never had one (a
  // replica restarted before the lighthouse missed its old process would otherwise get the old
  // quorum's id and meet its peers under the old group's keys: regression
  // StalledHealHeldTheQuorum).
  bool fresh_group = true;
  int64_t asked = 0;
  std::string nonce;        // this process's (its keys and its requests' tokens carry it)
  std::string fingerprint;  // the settings every replica of the job shares
  std::thread beater;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;

  // Rank 0's beats, on a connection of their own. A failed beat (the lighthouse busy or briefly
  // out of reach) connects again on the next one; quorum() reports a lighthouse that is gone.
  void beat(int replica_id, milliseconds every) {
    c10::intrusive_ptr<AuthStore> own;
    const std::string key = "ft/beat/" + std::to_string(replica_id) + "/" + nonce;
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      lock.unlock();
      try {
        if (!own) own = lighthouse_client(host, port, secret, milliseconds(2000));
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
    // Gloo's connect waits for the members' addresses, and connects, within `timeout`: a member
    // that never comes costs that alone (FaultTolerantReplicas.AMemberThatNeverConnects...).
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
  impl_->secret = options_.secret.empty() ? user_secret() : options_.secret;
  if (impl_->secret.empty()) {
    throw UsageError(
        "replica " + std::to_string(options_.replica_id) + ": the lighthouse at " +
        options_.lighthouse +
        " hears only processes that prove the job's secret, and none was given: set "
        "SCALETRAIN_SECRET_FILE=PATH (the lighthouse's) for every replica's launcher, or "
        "SCALETRAIN_SECRET (ReplicaGroupOptions::secret in a program; docs/resilience.md)");
  }
  try {
    impl_->store = lighthouse_client(host, port, impl_->secret, options_.timeout);
  } catch (const UsageError& e) {
    throw UsageError("replica " + std::to_string(options_.replica_id) + ": " + e.what());
  } catch (const Error& e) {
    throw Error("replica " + std::to_string(options_.replica_id) + ": " + e.what());
  }
  std::random_device device;
  std::ostringstream nonce;
  nonce << std::hex << device() << device() << device();
  impl_->nonce = nonce.str();
  impl_->fingerprint = options_.fingerprint + "|ranks=" + std::to_string(replica.size());
  for (char& c : impl_->fingerprint) c = c == ' ' ? '_' : c;
  if (replica.rank() == 0) {
    impl_->store->set("ft/reg/" + std::to_string(options_.replica_id) + "/" + impl_->nonce,
                      bytes(this_process()));
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
  // Goodbye: a new process of this replica (a restart) takes the id over at once, instead of
  // after the heartbeat timeout (Note [One process per replica id]).
  if (impl_->replica.rank() == 0) {
    try {
      impl_->store->deleteKey("ft/reg/" + std::to_string(options_.replica_id) + "/" + impl_->nonce);
    } catch (const std::exception&) {  // the lighthouse is gone: nothing to tell
    }
  }
}

// Rank 0 asks the lighthouse; its answer, or why it gave none.
std::string ReplicaGroup::ask(int64_t step) {
  auto& m = *impl_;
  const std::string me = "replica " + std::to_string(options_.replica_id);
  const std::string token = m.nonce + "-" + std::to_string(++m.asked);
  try {
    m.store->set("ft/req/" + std::to_string(options_.replica_id) + "/" + m.nonce,
                 bytes(token + " " + std::to_string(step) + " " + (m.fresh_group ? "1" : "0") +
                       " " + m.fingerprint));
    m.store->wait({"ft/ans/" + token}, options_.quorum_timeout);
    const std::string answer = text(m.store->get("ft/ans/" + token));
    m.store->deleteKey("ft/ans/" + token);  // the lighthouse's store does not grow by a step
    return answer;
  } catch (const c10::DistStoreError& e) {  // it answered nothing in time
    throw Error(me + ": the lighthouse at " + options_.lighthouse + " gave no quorum within " +
                seconds(options_.quorum_timeout) + " (fewer replicas than its --min-replicas are " +
                "alive, or it is stalled)");
  } catch (const c10::Error& e) {  // it is gone: one line, naming it
    throw Error(me + ": " + e.what_without_backtrace());
  }
}

// A refusal of the lighthouse, as the error this replica stops with.
void ReplicaGroup::refused(const std::string& answer) const {
  const std::string me = "replica " + std::to_string(options_.replica_id);
  if (answer.rfind("refused-duplicate ", 0) == 0) {
    throw UsageError(me + ": another live process already trains as " + me + " (" +
                     answer.substr(18) +
                     "): give each replica its own ReplicaGroupOptions::replica_id");
  }
  if (answer.rfind("refused-step ", 0) == 0) {
    throw Error(me + ": the lighthouse refused its step: the job is at step " + answer.substr(13) +
                ", and a replica is never ahead of it (is this replica's "
                "TrainerOptions::out_dir another job's folder?)");
  }
  throw UsageError(me + ": its settings differ from the job's (" +
                   differences(answer.substr(8), impl_->fingerprint) +
                   "): every replica of a job needs the same ones, or give it a lighthouse of its "
                   "own. The job trains with: " +
                   answer.substr(8));
}

Quorum ReplicaGroup::quorum(int64_t step) {
  auto& m = *impl_;
  std::string answer;
  if (m.replica.rank() == 0) answer = ask(step);
  answer = dist_text::broadcast_text(m.replica, answer, "the quorum");
  Quorum q;
  if (answer.rfind("refused", 0) == 0) refused(answer);
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
  if (impl_->replica.rank() == 0) {
    impl_->store->set("ft/done/" + std::to_string(options_.replica_id) + "/" + impl_->nonce,
                      bytes(std::to_string(step)));
  }
}

int ReplicaGroup::live() const { return std::max(impl_->quorum.size(), 1); }

}  // namespace scaletrain
