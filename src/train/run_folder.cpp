// Note [Run identity]
// ~~~~~~~~~~~~~~~~~~~
// A folder given to --out holds at most one run, and a run never deletes or mixes with another
// run's files (the data loss this prevents: a fresh run in a finished run's folder pruned the new
// run's checkpoints by step number, kept the old ones, appended to the old metrics, and a later
// --resume auto picked the old run).
//
// - Each run has an id, written into every checkpoint's header and into run.json; checkpoints
//   are pruned among those of the same id only (checkpoint.h).
// - A run that resumes a checkpoint continues that checkpoint's run and id; metric lines past
//   the checkpoint's step, written by the attempt that died, are dropped.
// - A fresh run (--resume none, or auto with nothing valid to resume) in a folder holding run
//   files is refused, naming the files and the three ways on: --resume auto, another --out, or
//   --overwrite, which deletes exactly those files (run_files()) first.
// - Except a launcher's restart of the same run (TORCHELASTIC_RESTART_COUNT > 0 and run.json
//   naming this launch's TORCHELASTIC_RUN_ID) that died before its first checkpoint: it starts
//   over in its own folder, with its own id.

// Note [Folder owner]
// ~~~~~~~~~~~~~~~~~~~
// Two runs writing one folder at once lose work silently: a second `--resume auto` run took the
// live run's checkpoint and trained on beside it (both exited 0, one set of checkpoints left), and
// two fresh runs raced for the same temporary file. The folder therefore has an owner, rank 0 of
// the run that trains in it, for the whole of train(): an exclusive lock of an open file
// description (fcntl's F_OFD_SETLK) on `.scaletrain.lock`, which the kernel drops when the process
// ends, by SIGKILL too, so a dead run never blocks its own resume. The lock file holds the owner's
// process id, host and start time; a second run is refused naming them. validate() tests the lock
// too (F_OFD_GETLK, which takes nothing: a test that took the lock for a moment made the owner's
// rank 0 fail when another rank of its run validated at that instant), so that a second
// `scaletrain train` fails before it starts any worker.

#include "train/run_folder.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "checkpoint/checkpoint_dcp.h"
#include "runtime/atomic_file.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"
#include "scaletrain/zero.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

std::string random_id() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%08x%08x", rd(), rd());
  return buf;
}

nlohmann::json read_record(const std::string& dir) {
  std::ifstream in(dir + "/run.json");
  if (!in) return nlohmann::json::object();
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception&) {
    return nlohmann::json::object();
  }
}

// An earlier attempt of this launch (Note [Run identity]): its id, to start over under.
std::optional<std::string> own_earlier_attempt(const std::string& dir) {
  const std::string launch = env_or("TORCHELASTIC_RUN_ID", "none");
  if (launch == "none" || std::atoi(env_or("TORCHELASTIC_RESTART_COUNT", "0").c_str()) <= 0) {
    return std::nullopt;
  }
  auto record = read_record(dir);
  if (record.value("launch_id", "") != launch) return std::nullopt;
  return record.value("run_id", "");
}

std::string listing(const std::vector<fs::path>& files) {
  std::string out;
  for (size_t i = 0; i < files.size() && i < 3; ++i) {
    out += (i ? ", " : "") + files[i].filename().string();
  }
  if (files.size() > 3) out += " and " + std::to_string(files.size() - 3) + " more";
  return out;
}

int64_t step_of(const std::string& checkpoint) {
  const std::string stem = fs::path(checkpoint).stem().string();  // ckpt-<step>
  try {
    return std::stoll(stem.substr(5));
  } catch (const std::exception&) {
    return -1;
  }
}

bool is_inside(const fs::path& file, const fs::path& dir) {
  std::error_code ec;
  return fs::equivalent(fs::absolute(file).parent_path(), fs::absolute(dir), ec);
}

constexpr const char* kLockName = "/.scaletrain.lock";

struct flock whole_file(short type) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file
  return fl;
}

// Opens the lock file and tries to lock it: the fd when locked (or -2 where the file system
// has no locks), -1 when another open file holds it.
int try_lock(const std::string& dir) {
  const std::string path = dir + kLockName;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return -2;  // an unwritable folder is validate_output()'s to report
  auto fl = whole_file(F_WRLCK);
  if (::fcntl(fd, F_OFD_SETLK, &fl) == 0) return fd;
  const int err = errno;
  ::close(fd);
  return err == EAGAIN || err == EACCES ? -1 : -2;
}

std::string describe_holder(const std::string& dir) {
  std::ifstream in(dir + kLockName);
  std::string line;
  std::getline(in, line);
  return line.empty() ? "another process" : line;
}

[[noreturn]] void refuse_busy(const std::string& dir, const std::string& holder) {
  throw UsageError("the output folder '" + dir + "' is in use by a live run (" + holder +
                   "): wait for it to end, stop it, or choose another TrainerOptions::out_dir");
}

}  // namespace

FolderLock::FolderLock(const std::string& dir) {
  fd_ = try_lock(dir);
  if (fd_ == -1) refuse_busy(dir, describe_holder(dir));
  if (fd_ < 0) return;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const std::string who =
      "process " + std::to_string(::getpid()) + " on host " + host + ", started " + when + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] auto n = ::pwrite(fd_, who.data(), who.size(), 0);
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::optional<std::string> FolderLock::holder(const std::string& dir) {
  // A test, not a take: a check never makes the owner's own lock fail (every rank validates,
  // and rank 0 takes the lock meanwhile).
  const int fd = ::open((dir + kLockName).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  auto fl = whole_file(F_WRLCK);
  const bool held = ::fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
  ::close(fd);
  if (!held) return std::nullopt;
  return describe_holder(dir);
}

std::string tensor_slice_dir(const std::string& dir, int tp, int slice) {
  return (fs::path(dir) / ("tp" + std::to_string(tp) + "-" + std::to_string(slice))).string();
}

namespace {
// "tp<T>-<t>" with 0 <= t < T: a slice's folder (Note [Sharded checkpoints per slice]).
std::optional<std::pair<int, int>> slice_of_folder(const std::string& name) {
  int tp = 0, slice = 0;
  char tail = 0;
  if (std::sscanf(name.c_str(), "tp%d-%d%c", &tp, &slice, &tail) != 2) return std::nullopt;
  if (tp < 2 || slice < 0 || slice >= tp ||
      name != "tp" + std::to_string(tp) + "-" + std::to_string(slice)) {
    return std::nullopt;
  }
  return std::pair{tp, slice};
}
// The run that wrote a slice's checkpoint of `step` (its first world's rank 0 file).
std::optional<std::string> run_of_slice(const std::string& folder, int64_t step) {
  std::error_code ec;
  for (auto& w : fs::directory_iterator(folder, ec)) {
    const fs::path file = w.path() / "rank-0" / ("ckpt-" + std::to_string(step) + ".st");
    if (fs::exists(file, ec)) return checkpoint_run(file.string());
  }
  return std::nullopt;
}
}  // namespace

std::optional<ShardedFound> newest_sharded(const std::string& dir) {
  std::optional<ShardedFound> best;
  if (auto own = newest_sharded_checkpoint(dir)) best = ShardedFound{*own, 1};
  std::map<int, std::map<int, std::string>> slices;  // degree -> slice -> folder
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const auto slice = slice_of_folder(e.path().filename().string());
    if (slice && e.is_directory(ec)) slices[slice->first][slice->second] = e.path().string();
  }
  for (const auto& [tp, folders] : slices) {
    if (static_cast<int>(folders.size()) != tp) continue;  // a slice's folder is missing
    // The newest step every slice holds complete, and every slice's of one run (the slices
    // rotate their files on their own: one may have dropped a step another still needs).
    std::map<int64_t, int> holders;  // step -> slices that have its files
    for (const auto& [slice, folder] : folders) {
      for (int64_t step : sharded_checkpoint_steps(folder)) ++holders[step];
    }
    for (auto it = holders.rbegin(); it != holders.rend(); ++it) {
      const int64_t step = it->first;
      if (best && step <= best->step) break;
      if (it->second != tp) continue;
      std::set<std::optional<std::string>> runs;
      bool complete = true;
      for (const auto& [slice, folder] : folders) {
        complete = complete && sharded_checkpoint_complete(folder, step);
        if (complete) runs.insert(run_of_slice(folder, step));
      }
      if (complete && runs.size() == 1) {
        best = ShardedFound{step, tp};
        break;
      }
    }
  }
  return best;
}

std::vector<fs::path> run_files(const std::string& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    const bool ckpt =
        name.rfind("ckpt-", 0) == 0 && (e.path().extension() == ".st" || tmp ||
                                        (is_dcp_checkpoint_name(name) && e.is_directory(ec)));
    const bool shards = e.is_directory(ec) && (name.rfind("world-", 0) == 0 ||  // sharded ones
                                               slice_of_folder(name).has_value());
    if (ckpt || shards || name == "metrics.jsonl" || name == "model.pt" || name == "run.json" ||
        (tmp && name.rfind("model.pt.", 0) == 0) || name.rfind("events.out.tfevents.", 0) == 0) {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

RunStart plan_run_start(const TrainerOptions& o) {
  RunStart s;
  if (o.resume.kind == Resume::Kind::kAuto && !o.overwrite) {
    s.resume_from = newest_valid_checkpoint(o.out_dir);
    // The newer of the one-file and the sharded checkpoints (a run may change its format).
    const auto sharded = newest_sharded(o.out_dir);
    if (sharded && (!s.resume_from || sharded->step > step_of(*s.resume_from))) {
      s.resume_from.reset();
      s.resume_sharded = sharded->step;
      s.resume_sharded_tp = sharded->tp;
      return s;
    }
  } else if (o.resume.kind == Resume::Kind::kFile) {
    s.resume_from = o.resume.file;
  }
  const auto files = run_files(o.out_dir);
  if (s.resume_from && (files.empty() || is_inside(*s.resume_from, o.out_dir))) return s;
  if (files.empty()) {
    s.run_id = random_id();
    return s;
  }
  if (o.overwrite) {
    for (const auto& f : files) {
      if (!s.resume_from || !fs::equivalent(f, *s.resume_from)) s.stale.push_back(f);
    }
    if (!s.resume_from) s.run_id = random_id();
    return s;
  }
  if (!s.resume_from) {
    if (auto earlier = own_earlier_attempt(o.out_dir)) {
      s.run_id = earlier->empty() ? random_id() : *earlier;
      for (const auto& f : files) {
        if (f.filename() == "metrics.jsonl") s.stale.push_back(f);
      }
      return s;
    }
  }
  const bool resumable =
      newest_valid_checkpoint(o.out_dir).has_value() || newest_sharded(o.out_dir).has_value();
  throw UsageError("the output folder '" + o.out_dir + "' holds another run (" + listing(files) +
                   (resumable ? "); continue it with TrainerOptions::resume auto, choose another "
                                "TrainerOptions::out_dir, or give "
                                "TrainerOptions::overwrite to delete those files first"
                              : "), which wrote no valid checkpoint to resume from; choose another "
                                "TrainerOptions::out_dir, or give TrainerOptions::overwrite to "
                                "delete those files first"));
}

void begin_run(const TrainerOptions& o, const RunStart& start, const std::string& run_id,
               const std::string& model_name) {
  std::error_code ec;
  for (const auto& f : start.stale) fs::remove_all(f, ec);
  // Regression (StaleTemporariesStayedInAFinishedFolder): Note [Folder cleanup].
  remove_dead_temporaries(o.out_dir);
  if (!start.run_id.empty() || !fs::exists(o.out_dir + "/run.json")) {
    const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    char when[32];
    std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    nlohmann::json record = {
        {"run_id", run_id},    {"launch_id", env_or("TORCHELASTIC_RUN_ID", "none")},
        {"model", model_name}, {"strategy", to_string(o.strategy)},
        {"started", when},     {"scaletrain", version()}};
    const std::string tmp = o.out_dir + "/run.json.tmp";
    std::ofstream(tmp) << record.dump(2) << "\n";
    fs::rename(tmp, o.out_dir + "/run.json", ec);
  }
}

// Note [Folder cleanup]
// ~~~~~~~~~~~~~~~~~~~~~
// A write killed before its rename (a checkpoint in the background when its process died) leaves
// its temporary, `<file>.<pid>-<n>.tmp`. A later checkpoint in the same folder removes those a
// minute old whose writer is gone (checkpoint.cpp), but not in a folder no later checkpoint
// writes (the shards of another world size), nor one that young: a finished run's folder kept
// them. Rank 0 of a run therefore clears them at two moments when no rank of the run writes and
// it holds the folder (Note [Folder owner]): when the run starts, before any checkpoint, and
// when it ends, once every rank's last write is on disk. The writers of what is left then are
// gone, so a pid that is no live process here is enough (no minute's wait); a temporary whose pid
// is some live process here is kept, in doubt.
namespace {

bool is_world_folder(const fs::directory_entry& e) {
  std::error_code ec;
  return e.is_directory(ec) && e.path().filename().string().rfind("world-", 0) == 0;
}

// The rank-<r> folders of sharded checkpoints in `dir`: world-<N>/rank-<r>, and the same under
// each slice's tp<T>-<t>/ (Note [Sharded checkpoints per slice]).
std::vector<fs::path> shard_folders(const std::string& dir) {
  std::vector<fs::path> worlds, out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    if (is_world_folder(e)) worlds.push_back(e.path());
    if (!e.is_directory(ec) || !slice_of_folder(e.path().filename().string())) continue;
    for (auto& w : fs::directory_iterator(e.path(), ec)) {
      if (is_world_folder(w)) worlds.push_back(w.path());
    }
  }
  for (const auto& w : worlds) {
    for (auto& r : fs::directory_iterator(w, ec)) {
      if (r.is_directory(ec) && r.path().filename().string().rfind("rank-", 0) == 0) {
        out.push_back(r.path());
      }
    }
  }
  return out;
}

}  // namespace

int remove_dead_temporaries(const std::string& dir) {
  const std::chrono::seconds now(0);
  int removed =
      remove_stale_temporaries(dir, "ckpt-", now) + remove_stale_temporaries(dir, "model.pt.", now);
  std::error_code ec;
  for (const char* fixed : {"/run.json.tmp", "/metrics.jsonl.tmp"}) {  // rank 0's own alone
    removed += fs::remove(dir + fixed, ec) ? 1 : 0;
  }
  for (const auto& folder : shard_folders(dir)) {
    removed += remove_stale_temporaries(folder.string(), "ckpt-", now);
  }
  return removed;
}

bool holds_sharded_checkpoints(const std::string& dir) { return !shard_folders(dir).empty(); }

// Note [Format switch]: a run that resumed from sharded checkpoints and goes on with full ones
// (TrainerOptions::checkpoint_format full) left every shard behind: a folder of the one-file
// format holding a world's worth of stale shards, which --resume auto would even prefer over an
// older full file. Once a full checkpoint is on disk (renamed and synced, never before: until
// then the shards are what a resume needs), its run's shards of that step and earlier are
// removed. Another run's shards are not this run's to delete (Note [Run identity]).
void remove_replaced_shards(const std::string& dir, const std::string& run_id, int64_t step) {
  std::error_code ec;
  std::set<fs::path> touched;
  for (const auto& folder : shard_folders(dir)) {
    for (auto& e : fs::directory_iterator(folder, ec)) {
      const auto& f = e.path();
      if (f.extension() != ".st" || f.filename().string().rfind("ckpt-", 0) != 0) continue;
      const int64_t s = step_of(f.string());
      if (s < 0 || s > step || checkpoint_run(f.string()) != run_id) continue;
      fs::remove(f, ec);
    }
    touched.insert(folder);
  }
  // Folders left empty, from rank-<r> up to world-<N> and tp<T>-<t>, never above them.
  auto shard_level = [](const fs::path& p) {
    const std::string name = p.filename().string();
    return name.rfind("rank-", 0) == 0 || name.rfind("world-", 0) == 0 ||
           slice_of_folder(name).has_value();
  };
  for (const auto& folder : touched) {
    for (fs::path p = folder; shard_level(p); p = p.parent_path()) {
      if (!fs::is_empty(p, ec) || ec || !fs::remove(p, ec)) break;
    }
  }
}

void drop_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      if (nlohmann::json::parse(line).value("step", int64_t{0}) > step) continue;
    } catch (const std::exception&) {
      continue;  // a line cut short by the crash
    }
    kept += line + "\n";
  }
  in.close();
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << kept;
  std::error_code ec;
  fs::rename(tmp, path, ec);
}

}  // namespace scaletrain
