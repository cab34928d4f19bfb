#include "scaletrain/parallel_dims.h"

#include <algorithm>
#include <utility>

#include "scaletrain/error.h"

namespace scaletrain {

namespace {

// The degrees by name, in mesh order (dp_replicate and dp_shard both before cp).
std::vector<std::pair<const char*, int>> degrees(const ParallelDims& d) {
  return {{"dp_replicate", d.dp_replicate},
          {"dp_shard", d.dp_shard},
          {"cp", d.cp},
          {"pp", d.pp},
          {"tp", d.tp}};
}

int* degree_named(ParallelDims& d, const std::string& name) {
  if (name == "dp_replicate") return &d.dp_replicate;
  if (name == "dp_shard") return &d.dp_shard;
  if (name == "pp") return &d.pp;
  if (name == "cp") return &d.cp;
  return &d.tp;
}

void check_zero_stage(const ParallelDims& d) {
  if (d.zero_stage < 0 || d.zero_stage > 3) {
    throw UsageError("ParallelDims::zero_stage " + std::to_string(d.zero_stage) +
                     " is not a ZeRO stage: give 0 (none), 1, 2 or 3 (fsdp)");
  }
  if (d.zero_stage == 0 && d.dp_shard != 1) {
    throw UsageError("ParallelDims::dp_shard " + std::to_string(d.dp_shard) +
                     " shards nothing with ParallelDims::zero_stage 0: give a stage of 1, 2 or 3, "
                     "or replicate with ParallelDims::dp_replicate");
  }
  if (d.zero_stage > 0 && d.dp_replicate != 1) {
    throw UsageError(
        "ParallelDims::dp_replicate " + std::to_string(d.dp_replicate) + " with dp_shard " +
        std::to_string(d.dp_shard) +
        " (a hybrid of replicas and shards) is not supported yet: shard over the whole "
        "data-parallel dimension (dp_replicate 1, dp_shard -1)");
  }
}

}  // namespace

ParallelDims ParallelDims::resolve(int world) const {
  if (world < 1) {
    throw UsageError("a world of " + std::to_string(world) + " ranks: it needs at least 1");
  }
  check_zero_stage(*this);
  const char* rest = nullptr;
  long known = 1;
  for (const auto& [name, degree] : degrees(*this)) {
    if (degree == -1) {
      if (rest) {
        throw UsageError(std::string("ParallelDims::") + rest + " and ParallelDims::" + name +
                         " are both -1 (the rest of the world): give one of them a degree");
      }
      rest = name;
    } else if (degree < 1) {
      throw UsageError(std::string("ParallelDims::") + name + " " + std::to_string(degree) +
                       ": a degree is at least 1 (or -1: the rest of the world)");
    } else {
      known *= degree;
    }
  }
  ParallelDims r = *this;
  if (rest) {
    if (world % known != 0) {
      throw UsageError("the world of " + std::to_string(world) + " ranks does not divide by " +
                       describe() + " (" + std::to_string(known) + " ranks a " + rest +
                       " coordinate): give a world that is a multiple of " + std::to_string(known));
    }
    *degree_named(r, rest) = static_cast<int>(world / known);
  } else if (known != world) {
    throw UsageError(describe() + " makes " + std::to_string(known) + " ranks, and the world has " +
                     std::to_string(world) +
                     ": make the degrees' product the world size (or one degree -1, the rest)");
  }
  if (ep < 1 || r.dp_cp() % ep != 0) {
    throw UsageError("ParallelDims::ep " + std::to_string(ep) +
                     ": the expert-parallel degree is at least 1 and divides dp x cp (" +
                     std::to_string(r.dp_cp()) + " ranks here, " + r.describe() +
                     "); give an ep degree that divides it");
  }
  return r;
}

DeviceMesh ParallelDims::mesh(const std::vector<std::string>& names) const {
  for (const auto& n : names) {
    if (n != "dp" && n != "pp" && n != "cp" && n != "tp") {
      throw UsageError("ParallelDims has no mesh dimension '" + n + "': dp, pp, cp or tp");
    }
  }
  for (const auto& [name, degree] : degrees(*this)) {
    if (degree < 1) {
      throw UsageError("ParallelDims " + describe() + " is not resolved (ParallelDims::" + name +
                       " " + std::to_string(degree) + "): call resolve(world) first");
    }
  }
  const std::vector<MeshDim> all{{"dp", dp()}, {"cp", cp}, {"pp", pp}, {"tp", tp}};
  std::vector<MeshDim> dims;
  for (const auto& d : all) {
    const bool named = std::find(names.begin(), names.end(), d.name) != names.end();
    if (named) {
      dims.push_back(d);
    } else if (d.size != 1) {
      throw UsageError("a mesh without dimension '" + d.name + "' from " + describe() +
                       ": its degree is " + std::to_string(d.size) + ", not 1");
    }
  }
  if (dims.empty()) dims.push_back({"dp", 1});
  return DeviceMesh(std::move(dims), world());
}

std::string ParallelDims::describe() const {
  auto degree = [](int n) { return n == -1 ? std::string("rest") : std::to_string(n); };
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : " x ") + part; };
  if (dp_replicate != 1 || (dp_shard == 1 && zero_stage == 0 && pp == 1 && cp == 1 && tp == 1)) {
    add("dp " + degree(dp_replicate));
  }
  if (dp_shard != 1 || zero_stage != 0) {
    add("dp " + degree(dp_shard) + " (" +
        (zero_stage == 3 ? std::string("fsdp") : "zero" + std::to_string(zero_stage)) + ")");
  }
  if (cp != 1) add("cp " + degree(cp));
  if (pp != 1) add("pp " + degree(pp));
  if (tp != 1) add("tp " + degree(tp));
  if (ep != 1) out += " (ep " + std::to_string(ep) + ")";
  return out;
}

}  // namespace scaletrain
