#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>
#include <thread>

#include "dist/auth_store.h"
#include "dist/heartbeat.h"
#include "dist/nccl_module.h"
#include "dist/text.h"
#include "launch/net.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "scaletrain/secret.h"
#include "scaletrain/version.h"

namespace scaletrain {
namespace {

using std::chrono::milliseconds;

std::string where(const World& w) { return w.master_addr + ":" + std::to_string(w.master_port); }

using dist_text::seconds;

// The local address this host uses to reach the master: the interface Gloo should listen on.
// Connecting a UDP socket sends nothing; it only asks the kernel for a route.
std::string local_address_towards(const std::string& master_addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(master_addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    throw Error("cannot resolve master address '" + master_addr +
                "'; set MASTER_ADDR (or --master-addr) to a host name or IPv4 address of rank 0");
  }
  std::string out = "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN] = {};
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)) != nullptr) out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

milliseconds rendezvous_timeout(const InitOptions& o) {
  if (const char* s = std::getenv("SCALETRAIN_RDZV_TIMEOUT")) {
    char* end = nullptr;
    double v = std::strtod(s, &end);
    if (*end != '\0' || v <= 0) {
      throw UsageError(std::string("SCALETRAIN_RDZV_TIMEOUT='") + s +
                       "' is not a positive number of seconds");
    }
    return milliseconds(static_cast<long>(v * 1000));
  }
  return o.rendezvous_timeout;
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// A socket listening on 127.0.0.1:port only, for the store of a single-node job: no process
// of another host can even reach it. Returns -1 when the port cannot be had (the store then
// reports the error in its own words).
int listen_on_loopback(int port) {
  return net::bind_tcp(port, /*loopback_only=*/true, /*listen=*/true);
}

// The secret of the world's store (Note [Job secret]): the launcher's, else the user's.
std::string world_secret(const InitOptions& o) {
  if (!o.secret.empty()) return o.secret;
  if (const char* s = std::getenv(kWorldSecretEnv); s != nullptr && *s != '\0') return s;
  return user_secret();
}

// Rank 0 serves the store on MASTER_ADDR's interface (loopback stays loopback), to processes
// that prove the job's secret; every rank, rank 0 included, is a client.
c10::intrusive_ptr<c10d::Store> connect_auth_store(const World& w, const std::string& secret,
                                                   milliseconds timeout) {
  std::shared_ptr<StoreServer> server;
  if (w.rank == 0) {
    StoreServerOptions so;
    so.host = w.master_addr;
    so.port = w.master_port;
    so.secret = secret;
    try {
      server = std::make_shared<StoreServer>(so);
    } catch (const Error& e) {
      throw Error("rank 0 could not serve the rendezvous store: " + std::string(e.what()) +
                  "\nThe port may be taken by another job: choose another --master-port "
                  "(MASTER_PORT), or 0 to let `scaletrain run` pick a free one; MASTER_ADDR "
                  "must be an address of rank 0's machine.");
    }
  }
  AuthStoreOptions co;
  co.host = w.master_addr;
  co.port = w.master_port;
  co.secret = secret;
  co.what = "the store of run '" + w.run_id + "'";
  co.timeout = timeout;
  try {
    return c10::make_intrusive<AuthStore>(co, server);
  } catch (const c10::Error& e) {
    throw Error("rank " + std::to_string(w.rank) + ": " + e.what_without_backtrace() +
                "\nCheck that rank 0 is running and that MASTER_ADDR/MASTER_PORT point at it.");
  }
}

c10::intrusive_ptr<c10d::Store> connect_store(const World& w, const InitOptions& options,
                                              milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(w.master_port);
  // Under torchrun the agent already serves a store on MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, is then a client.
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && std::string(agent) == "True";
  if (!agent_store) {
    if (const std::string secret = world_secret(options); !secret.empty()) {
      return connect_auth_store(w, secret, timeout);
    }
  }
  o.isServer = w.rank == 0 && !agent_store;
  o.waitWorkers = false;
  o.timeout = timeout;
  if (o.isServer && w.num_nodes == 1 && is_loopback(w.master_addr)) {
    int fd = listen_on_loopback(w.master_port);
    if (fd >= 0) o.masterListenFd = fd;
  }
  try {
    return c10::make_intrusive<c10d::TCPStore>(w.master_addr, o);
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);  // its words, not a backtrace
    const std::string why = c10_error ? c10_error->what_without_backtrace() : e.what();
    if (w.rank == 0) {
      throw Error("rank 0 could not serve the rendezvous store on " + where(w) + ": " + why +
                  "\nThe port may be taken by another job: choose another --master-port "
                  "(MASTER_PORT), or 0 to let `scaletrain run` pick a free one.");
    }
    throw Error("rank " + std::to_string(w.rank) + " could not reach the rendezvous store at " +
                where(w) + " within " + seconds(timeout) + ": " + why +
                "\nCheck that rank 0 is running and that MASTER_ADDR/MASTER_PORT point at it.");
  }
}

// Every rank must see the world rank 0 sees: a rank started with another WORLD_SIZE used to hang
// (rank 0 waited for ranks that would never come, or the odd rank waited for a go that came
// before it) or fail with a raw network error. The odd rank says so in the store, naming
// itself and both sizes; rank 0 stops waiting and passes the verdict on to the rest.
void check_world_size(c10d::Store& store, const World& w, const std::string& p) {
  if (w.rank == 0) return;
  store.wait({p + "world_size"});
  auto raw = store.get(p + "world_size");
  const std::string theirs(raw.begin(), raw.end());
  if (theirs == std::to_string(w.world_size)) return;
  const std::string why = "rank " + std::to_string(w.rank) + " was started with WORLD_SIZE " +
                          std::to_string(w.world_size) + " and rank 0 with " + theirs +
                          ": every process of a job needs the same world size (the same "
                          "--nnodes and --nproc-per-node on every node, or WORLD_SIZE)";
  store.set(p + "odd", why);
  throw Error(why);
}

// Note [Rendezvous]: see dist.h. Keys live under "scaletrain/rdzv/<restart>/": a store that
// outlives a restart (torchrun's agent store) must not see the last attempt's claims.
void rendezvous(c10d::Store& store, const World& w, milliseconds timeout) {
  const std::string p = "scaletrain/rdzv/" + std::to_string(w.restart_count) + "/";
  const std::string me = "rank " + std::to_string(w.rank);
  if (w.rank == 0) {
    store.set(p + "world_size", std::to_string(w.world_size));
    store.set(p + "run_id", w.run_id);
  }
  try {
    store.wait({p + "run_id"}, timeout);
  } catch (const std::exception&) {
    throw Error(me + ": the store at " + where(w) + " did not say which run it serves within " +
                seconds(timeout) + "; is rank 0 of run '" + w.run_id + "' alive?");
  }
  auto raw = store.get(p + "run_id");
  std::string served(raw.begin(), raw.end());
  if (served != w.run_id) {
    throw Error(me + " of run '" + w.run_id + "' reached the store at " + where(w) +
                ", which serves run '" + served +
                "': refusing to join another job. Give each job its own --master-port, or the "
                "same --run-id on every node of one job.");
  }
  check_world_size(store, w, p);
  int64_t claims = store.add(p + "rank/" + std::to_string(w.rank), 1);
  if (claims > 1) {
    throw Error(me + " of run '" + w.run_id + "' is claimed by more than one process at " +
                where(w) + "; every process needs its own RANK (check --node-rank on each node)");
  }
  if (w.rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < w.world_size; ++r) keys.push_back(p + "rank/" + std::to_string(r));
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!store.check(keys)) {
      if (store.check({p + "odd"})) {  // a rank of another world size (check_world_size())
        auto odd = store.get(p + "odd");
        const std::string why(odd.begin(), odd.end());
        store.set(p + "go", "refused: " + why);
        throw Error("rank 0: " + why);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::string missing;
        int n = 0;
        for (int r = 0; r < w.world_size; ++r) {
          if (!store.check({keys[r]})) {
            missing += (n++ ? ", " : "") + std::to_string(r);
          }
        }
        throw Error("rendezvous of run '" + w.run_id + "' at " + where(w) + " timed out after " +
                    seconds(timeout) + ": " + std::to_string(n) + " of " +
                    std::to_string(w.world_size) + " ranks never arrived (ranks " + missing +
                    "). Start them, check --nnodes/--nproc-per-node on every node, or raise "
                    "--rdzv-timeout.");
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    store.set(p + "go", "1");
  } else {
    try {
      store.wait({p + "go"}, timeout);
    } catch (const std::exception&) {
      throw Error(me + ": rendezvous of run '" + w.run_id + "' at " + where(w) +
                  " did not complete within " + seconds(timeout) +
                  ": rank 0 is still waiting for other ranks, or has died. Check the other "
                  "nodes, or raise --rdzv-timeout.");
    }
    auto go = store.get(p + "go");
    const std::string verdict(go.begin(), go.end());
    if (verdict != "1") throw Error(me + ": rendezvous " + verdict);
  }
}

}  // namespace

void require_joined(const Dist& dist, const std::string& who) {
  if (!dist.backend) {
    throw UsageError(who +
                     ": the Dist is not joined (a default-constructed Dist has no process "
                     "group); pass the one init_process_group() returns, which also runs alone "
                     "as a world of one");
  }
}

namespace {

// wait_for's work, for a group of `size` whose collectives time out after `timeout`.
void wait_in(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, int rank, int size,
             milliseconds timeout, const Heartbeat* heartbeat) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string what = e.what();
    bool timed_out =
        what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
    const std::string silent = timed_out && heartbeat ? heartbeat->silent_ranks() : "";
    throw Error("rank " + std::to_string(rank) + " of " + std::to_string(size) + ": " + op +
                (timed_out ? " timed out after " + seconds(timeout) + " (collective timeout)" +
                                 (silent.empty() ? "" : "; " + silent + ".") +
                                 " Some rank never joined it. Look "
                                 "for a rank that failed, stalled or took another code path; "
                                 "raise the timeout if the work is just slow (`scaletrain train "
                                 "--timeout SECONDS`, or InitOptions::timeout in a program)."
                           : " failed: " + what) +
                (timed_out ? "\n  backend said: " + what : ""));
  }
}

}  // namespace

void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op, const Dist& d) {
  wait_in(work, op, d.rank(), d.size(), d.timeout, d.heartbeat.get());
}

Pending::Pending(c10::intrusive_ptr<c10d::Work> work, std::string what, const Dist& dist)
    : work_(std::move(work)),
      what_(std::move(what)),
      rank_(dist.rank()),
      size_(dist.size()),
      timeout_(dist.timeout),
      heartbeat_(dist.heartbeat) {}

void Pending::wait() { wait(what_); }

void Pending::wait(const std::string& what) {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  wait_in(work, what, rank_, size_, timeout_, heartbeat_.get());
}

bool Pending::done() const { return !work_ || work_->isCompleted(); }

void Pending::abort() noexcept {
  if (!work_) return;
  try {
    work_->abort();
  } catch (const std::exception&) {  // withdrawn either way
  }
  work_.reset();
}

namespace {

// A backend over `store` in which this process is `rank` of `size`.
c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                               const World& w, int rank, int size,
                                               const std::string& backend, milliseconds timeout) {
  if (backend == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = timeout;
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(
          local_address_towards(w.master_addr, w.master_port)));
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  }
  if (backend == "nccl") {
#ifdef SCALETRAIN_WITH_NCCL
    if (cuda_device_count() == 0) {
      throw Error("rank " + std::to_string(w.rank) +
                  ": backend 'nccl' needs a CUDA GPU and none is visible; use backend 'gloo' "
                  "(or 'auto') on CPU");
    }
    std::string why;
    c10d::Backend* nccl = nccl_factory()(store.get(), rank, size, timeout.count(), &why);
    if (nccl == nullptr) throw Error("rank " + std::to_string(w.rank) + ": backend 'nccl': " + why);
    return c10::intrusive_ptr<c10d::Backend>::reclaim(nccl);
#else
    throw Error("backend 'nccl' is not available: this scaletrain was built without CUDA");
#endif
  }
  throw UsageError("unknown backend '" + backend + "'; use 'gloo', 'nccl' or 'auto'");
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> new_backend(const Dist& dist, const std::string& backend,
                                              const std::string& prefix, milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, dist.store);
  return make_backend(store, dist.world, dist.world.rank, dist.world.world_size, backend, timeout);
}

Dist clone_group(const Dist& dist, const std::string& prefix) {
  Dist g = dist;
  g.backend = new_backend(dist, dist.backend_name, prefix, dist.timeout);
  return g;
}

std::optional<Dist> new_group(const Dist& dist, const std::vector<int>& ranks,
                              const std::string& name) {
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= dist.size() || !seen.insert(r).second) {
      throw UsageError("new_group '" + name + "': rank " + std::to_string(r) +
                       " is out of range or repeated (world size " + std::to_string(dist.size()) +
                       ")");
    }
  }
  auto me = std::find(ranks.begin(), ranks.end(), dist.rank());
  if (me == ranks.end()) return std::nullopt;
  Dist g = dist;
  g.world.rank = static_cast<int>(me - ranks.begin());
  g.world.world_size = static_cast<int>(ranks.size());
  g.store = c10::make_intrusive<c10d::PrefixStore>("group/" + name, dist.store);
  g.backend = make_backend(g.store, dist.world, g.world.rank, g.world.world_size, dist.backend_name,
                           dist.timeout);
  return g;
}

std::map<std::string, Dist> mesh_groups(const Dist& world, const DeviceMesh& mesh,
                                        const std::string& name,
                                        const std::vector<std::string>& only) {
  if (mesh.world_size() != world.size()) {
    throw UsageError("the device mesh " + mesh.describe() + " is of " +
                     std::to_string(mesh.world_size()) + " ranks, and this world has " +
                     std::to_string(world.size()));
  }
  std::map<std::string, Dist> out;
  for (const auto& dim : only) mesh.size(dim);  // names a dimension of the mesh
  for (const auto& dim : mesh.dims()) {
    if (!only.empty() && std::find(only.begin(), only.end(), dim.name) == only.end()) continue;
    const auto groups = mesh.groups(dim.name);  // the same order on every rank
    for (size_t i = 0; i < groups.size(); ++i) {
      auto g = new_group(world, groups[i], name + "/" + dim.name + "/" + std::to_string(i));
      if (g) out.emplace(dim.name, std::move(*g));
    }
  }
  return out;
}

std::string resolve_backend(const std::string& backend, int gpus, int local_world_size) {
  if (backend != "auto") return backend;
  // NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so it needs a GPU per local
  // process; with fewer GPUs the processes share them over Gloo.
  return gpus > 0 && gpus >= local_world_size ? "nccl" : "gloo";
}

Dist init_process_group(const InitOptions& options) {
  validate(options);
  Dist d;
  d.world = options.world ? *options.world : discover_world();
  d.backend_name = options.backend;
  d.backend_name = resolve_backend(options.backend, cuda_device_count(), d.world.local_world_size);
  if (d.backend_name != "gloo" && d.backend_name != "nccl") {
    throw UsageError("unknown backend '" + options.backend + "'; use 'gloo', 'nccl' or 'auto'");
  }
  auto timeout = rendezvous_timeout(options);
  d.store = connect_store(d.world, options, timeout);
  rendezvous(*d.store, d.world, timeout);
  d.backend = new_backend(d, d.backend_name, "default_pg/" + std::to_string(d.world.restart_count),
                          options.timeout);
  d.timeout = options.timeout;
  if (options.heartbeat_interval.count() > 0 && d.size() > 1) {
    d.heartbeat = std::make_shared<Heartbeat>(d.world, *d.store, options.heartbeat_interval);
  }
  return d;
}

}  // namespace scaletrain
