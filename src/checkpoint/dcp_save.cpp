// Note [DCP save]
// Saving is DCP's two-phase plan, over the job's store instead of collectives (so that it works
// over Gloo and NCCL alike and moves only small text):
//
//   every rank   its local plan: each box's key, dtype, global shape, offsets, sizes ─┐
//   rank 0       gathers the plans; checks that every tensor has one shape and dtype   │ store
//                and that the boxes tile it (check_tiling); a box several ranks hold  │
//                is written by the lowest; makes the temporary folder; the decision ──┘
//   every rank   writes its items to TMP/__<rank>_0.distcp (fsync); its byte ranges ──┐ store
//   rank 0       the .metadata from them (fsync), renames TMP to DIR (fsync of the     │
//                parent), and tells every rank it is done ────────────────────────────┘
//
// A failure anywhere travels the same way: a rank whose plan is wrong or whose write fails puts
// its message where its plan or result would go, rank 0 removes the temporary folder and every
// rank throws the same error, naming the rank. No rank returns before DIR is complete, and DIR
// never exists half written: a crash leaves at most DIR.<pid>-<n>.tmp, which a later save into
// the same parent removes once its writer is gone (remove_stale_temporaries).

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_payload.h"
#include "runtime/atomic_file.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Text agreed over the ranks through the store, under a prefix of this save's own.
class Exchange {
 public:
  explicit Exchange(const Dist& d) : d_(d), rank_(d.joined() ? d.rank() : 0) {
    if (!d_.joined()) return;
    // Every rank counts its own saves; the ranks save together, so the counts agree.
    prefix_ = "scaletrain/dcp/" +
              std::to_string(d_.store_add("scaletrain/dcp/saves/" + std::to_string(rank_), 1)) +
              "/";
  }
  int rank() const { return rank_; }
  int size() const { return d_.joined() ? d_.size() : 1; }
  // Rank 0 gets every rank's `mine`, by rank; the others an empty list.
  std::vector<std::string> gather(const std::string& step, const std::string& mine) const {
    if (!d_.joined()) return {mine};
    d_.store_set(prefix_ + step + "/" + std::to_string(rank_), mine);
    std::vector<std::string> all;
    for (int r = 0; rank_ == 0 && r < size(); ++r)
      all.push_back(d_.store_get(prefix_ + step + "/" + std::to_string(r)));
    return all;
  }
  // Rank 0's `value` on every rank.
  std::string broadcast(const std::string& step, const std::string& value) const {
    if (!d_.joined()) return value;
    if (rank_ == 0) d_.store_set(prefix_ + step, value);
    return rank_ == 0 ? value : d_.store_get(prefix_ + step);
  }

 private:
  const Dist& d_;
  int rank_;
  std::string prefix_;
};

// This rank's plan: one entry per box and the values it would write; a box that is wrong is
// reported to rank 0 instead (so that no rank waits for a plan that never comes).
json local_plan(const DcpState& state) {
  json plan = {{"boxes", json::array()}, {"values", json::array()}, {"paths", json::object()}};
  try {
    for (const auto& b : state.tensors) {
      const std::string where = "the box of '" + b.key.name + "'";
      if (!b.tensor.defined()) throw UsageError(where + " has no tensor");
      const std::string dtype = dcp::dtype_name(b.tensor.scalar_type(), where);
      const Box box{b.offsets.empty() ? std::vector<int64_t>(b.tensor.dim(), 0) : b.offsets,
                    b.tensor.sizes().vec()};
      check_box(b.key.name, b.global_shape, box, "the box saved");
      plan["boxes"].push_back({{"name", b.key.name},
                               {"dtype", dtype},
                               {"shape", b.global_shape},
                               {"offsets", box.offsets},
                               {"sizes", box.sizes}});
      if (!b.key.path.empty()) plan["paths"][b.key.name] = b.key.path;
    }
    for (const auto& [key, value] : state.values) {
      plan["values"].push_back(key.name);
      if (!key.path.empty()) plan["paths"][key.name] = key.path;
    }
  } catch (const Error& e) {
    plan["error"] = e.what();
  }
  return plan;
}

// Rank 0: which rank writes which box, or the error every rank throws. A box several ranks hold
// goes to the lowest; a box of no elements of a tensor that has some is nobody's.
json decide(const std::vector<json>& plans, const std::string& tmp) {
  std::map<std::string, std::vector<Box>> chunks;  // the boxes written, by tensor
  std::map<std::string, std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>>> seen;
  std::map<std::string, std::pair<json, json>> kind;  // name -> (dtype, shape), the first seen
  std::vector<std::vector<size_t>> writes(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    if (plans[r].contains("error"))
      return {{"error", "rank " + std::to_string(r) + ": " + plans[r]["error"].get<std::string>()}};
    const json& boxes = plans[r]["boxes"];
    for (size_t i = 0; i < boxes.size(); ++i) {
      const json& b = boxes[i];
      const std::string name = b["name"];
      auto [it, fresh] = kind.emplace(name, std::make_pair(b["dtype"], b["shape"]));
      if (!fresh && (it->second.first != b["dtype"] || it->second.second != b["shape"])) {
        return {{"error", "ranks give tensor '" + name + "' different shapes or dtypes (" +
                              it->second.second.dump() + " " + it->second.first.get<std::string>() +
                              ", and rank " + std::to_string(r) + " " + b["shape"].dump() + " " +
                              b["dtype"].get<std::string>() + "); give every rank the same"}};
      }
      const Box where{b["offsets"], b["sizes"]};
      const bool empty = where.numel() == 0 && whole(b["shape"]).numel() > 0;
      if (empty || !seen[name].insert({where.offsets, where.sizes}).second) continue;
      chunks[name].push_back(where);
      writes[r].push_back(i);
    }
  }
  try {
    for (const auto& [name, list] : chunks)
      check_tiling(name, kind[name].second.get<std::vector<int64_t>>(), list);
  } catch (const Error& e) {
    return {{"error", e.what()}};
  }
  return {{"tmp", tmp}, {"writes", writes}};
}

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      throw Error("writing '" + path + "' failed (" + std::strerror(err) +
                  (err == ENOSPC ? "): the disk is full; free space and save again"
                                 : "): check the folder and the disk"));
    }
    done += static_cast<size_t>(n);
  }
}

// Writes this rank's file; returns where each item went.
json write_rank_file(const std::string& tmp, int rank, const DcpState& state,
                     const std::vector<size_t>& boxes) {
  const std::string file = "__" + std::to_string(rank) + "_0.distcp";
  const std::string path = tmp + "/" + file;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error("cannot write '" + path + "' (" + std::strerror(errno) + "): check the folder");
  json out = {{"file", file}, {"items", json::array()}, {"values", json::array()}};
  int64_t offset = 0;
  try {
    auto put = [&](const std::string& bytes) {
      write_all(fd, bytes, path);
      json where = {offset, static_cast<int64_t>(bytes.size())};
      offset += static_cast<int64_t>(bytes.size());
      return where;
    };
    for (size_t i : boxes) {
      const at::Tensor t = state.tensors[i].tensor.detach().to(at::kCPU).contiguous();
      out["items"].push_back({i, put(dcp::tensor_item(t))});
    }
    for (size_t v = 0; rank == 0 && v < state.values.size(); ++v)
      out["values"].push_back(put(dcp::value_item(state.values[v].second)));
    if (::fsync(fd) != 0)
      throw Error("syncing '" + path + "' failed (" + std::strerror(errno) + ")");
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

void sync_folder(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) ::fsync(fd), ::close(fd);
}

std::string uuid4() {
  std::random_device rd;
  std::string s;
  for (int i = 0; i < 16; ++i) {
    unsigned b = rd() & 0xff;
    if (i == 6) b = (b & 0x0f) | 0x40;  // version 4
    if (i == 8) b = (b & 0x3f) | 0x80;  // the RFC 4122 variant
    char h[3];
    std::snprintf(h, sizeof h, "%02x", b);
    s += h;
    if (i == 3 || i == 5 || i == 7 || i == 9) s += '-';
  }
  return s;
}

// Rank 0, before anything is written: the decision, or the error every rank throws.
json prepare(const std::string& dir, const std::vector<std::string>& texts,
             const DcpSaveOptions& options) {
  std::vector<json> plans;
  for (const auto& t : texts) plans.push_back(json::parse(t));
  std::error_code ec;
  if (fs::exists(dir, ec) && !options.replace) {
    return {{"error", "the checkpoint folder '" + dir +
                          "' exists already; save to a new folder, or set "
                          "DcpSaveOptions::replace to replace it"},
            {"usage", false}};
  }
  const fs::path target(dir);
  const std::string parent = target.parent_path().empty() ? "." : target.parent_path().string();
  fs::create_directories(parent, ec);
  remove_stale_temporaries(parent, target.filename().string() + ".");
  const std::string tmp = temporary_path(dir);
  json d = decide(plans, tmp);
  if (d.contains("error")) {
    d["usage"] = true;
    return d;
  }
  if (!fs::create_directory(tmp, ec)) {
    return {{"error", "cannot make the folder '" + tmp + "' (" + ec.message() + "): check that '" +
                          parent + "' is writable"},
            {"usage", false}};
  }
  return d;
}

// Moves the finished temporary folder to `dir`: a rename, or an exchange with the folder it
// replaces (removed after), so that `dir` is never absent once it existed.
void publish(const std::string& tmp, const std::string& dir, bool replace) {
  std::error_code ec;
  if (replace && fs::exists(dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0) {
      // A file system without the exchange: the old folder goes aside for a moment.
      const std::string old = temporary_path(dir);
      if (::rename(dir.c_str(), old.c_str()) != 0 || ::rename(tmp.c_str(), dir.c_str()) != 0)
        throw Error("cannot replace '" + dir + "' (" + std::strerror(errno) + ")");
      fs::remove_all(old, ec);
    } else {
      fs::remove_all(tmp, ec);  // now the old checkpoint
    }
  } else if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    throw Error("cannot rename '" + tmp + "' to '" + dir + "' (" + std::strerror(errno) +
                "): was the folder made meanwhile?");
  }
  const std::string parent = fs::path(dir).parent_path().string();
  sync_folder(parent.empty() ? "." : parent);
}

// Rank 0, once every rank has written: the metadata, and the folder in place. Returns the error
// every rank throws, or "".
std::string finish(const std::string& dir, const json& decision,
                   const std::vector<std::string>& plan_texts,
                   const std::vector<std::string>& result_texts, const DcpState& state,
                   const DcpSaveOptions& options) {
  const std::string tmp = decision["tmp"];
  try {
    dcp::Metadata m;
    for (size_t r = 0; r < plan_texts.size(); ++r) {
      const json plan = json::parse(plan_texts[r]), res = json::parse(result_texts[r]);
      if (res.contains("error")) {
        throw Error("rank " + std::to_string(r) +
                    " could not write its part: " + res["error"].get<std::string>());
      }
      for (const auto& [name, path] : plan["paths"].items()) m.paths.emplace(name, path);
      for (const auto& item : res["items"]) {
        const json& b = plan["boxes"][item[0].get<size_t>()];
        dcp::TensorEntry& t = m.tensors[b["name"]];
        t.dtype = b["dtype"];
        t.shape = b["shape"].get<std::vector<int64_t>>();
        t.chunks.push_back({Box{b["offsets"], b["sizes"]},
                            {res["file"], item[1][0].get<int64_t>(), item[1][1].get<int64_t>()}});
      }
      for (size_t v = 0; r == 0 && v < res["values"].size(); ++v) {
        m.values[state.values[v].first.name] = {res["file"], res["values"][v][0].get<int64_t>(),
                                                res["values"][v][1].get<int64_t>()};
      }
    }
    const std::string bytes = dcp::encode_metadata(m, uuid4());
    write_atomically(tmp + "/.metadata", bytes, "checkpoint metadata");
    if (options.before_publish) options.before_publish(tmp);
    sync_folder(tmp);
    publish(tmp, dir, options.replace);
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return e.what();
  }
  return "";
}

}  // namespace

void save_distributed_checkpoint(const std::string& dir, const DcpState& state, const Dist& dist,
                                 const DcpSaveOptions& options) {
  const Exchange ex(dist);
  const auto plans =
      ex.gather("plan", local_plan(state).dump(-1, ' ', false, json::error_handler_t::replace));
  json decision;
  if (ex.rank() == 0) decision = prepare(dir, plans, options);
  decision = json::parse(ex.broadcast("decision", decision.dump()));
  if (decision.contains("error")) {
    const std::string msg =
        "cannot save the checkpoint '" + dir + "': " + decision["error"].get<std::string>();
    if (decision["usage"].get<bool>()) throw UsageError(msg);
    throw Error(msg);
  }
  json result;
  try {
    const auto writes = decision["writes"][static_cast<size_t>(ex.rank())];
    result = write_rank_file(decision["tmp"], ex.rank(), state, writes);
  } catch (const std::exception& e) {
    result = {{"error", e.what()}};
  }
  const auto results = ex.gather("written", result.dump());
  std::string failure;
  if (ex.rank() == 0) failure = finish(dir, decision, plans, results, state, options);
  failure = ex.broadcast("done", failure);
  if (!failure.empty()) throw Error("cannot save the checkpoint '" + dir + "': " + failure);
}

}  // namespace scaletrain
