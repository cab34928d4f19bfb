#include "dist/model_sync.h"

#include <map>
#include <sstream>

#include "scaletrain/error.h"

namespace scaletrain {

std::string describe_param(const std::string& name, at::ScalarType dtype, at::IntArrayRef sizes) {
  std::ostringstream s;
  s << name << " " << c10::toString(dtype) << " " << sizes;
  return s.str();
}

std::string describe_param(const std::string& name, const at::Tensor& p) {
  return describe_param(name, p.scalar_type(), p.sizes());
}

static std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// Every rank publishes its parameter list in the store and compares all of them with rank 0's:
// every rank reaches the same verdict, so none is left waiting in a broadcast.
void verify_same_model(const Dist& d, const std::vector<std::string>& mine, const std::string& who,
                       int instance) {
  const std::string prefix = "scaletrain/" + who + "/" + std::to_string(instance) + "/params/";
  const std::string name = who == "ddp" ? "DistributedDataParallel" : "ShardedDataParallel";
  std::string joined;
  for (auto& m : mine) joined += m + "\n";
  d.store->set(prefix + std::to_string(d.rank()), joined);
  std::vector<std::vector<std::string>> all;
  for (int r = 0; r < d.size(); ++r) {
    try {
      d.store->wait({prefix + std::to_string(r)});
    } catch (const std::exception&) {
      throw Error("rank " + std::to_string(d.rank()) + ": " + name +
                  " construction timed out waiting for rank " + std::to_string(r) +
                  " to describe its model; construct " + name + " on every rank");
    }
    auto v = d.store->get(prefix + std::to_string(r));
    all.push_back(split_lines(std::string(v.begin(), v.end())));
  }
  for (int r = 1; r < d.size(); ++r) {
    const auto& a = all[0];
    const auto& b = all[static_cast<size_t>(r)];
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
      std::string x = i < a.size() ? a[i] : "(none)";
      std::string y = i < b.size() ? b[i] : "(none)";
      if (x == y) continue;
      throw Error("rank " + std::to_string(d.rank()) + ": " + name +
                  " needs the same model on every rank, but parameter #" + std::to_string(i) +
                  " differs between rank 0 and rank " + std::to_string(r) + ":\n  rank 0: " + x +
                  "\n  rank " + std::to_string(r) + ": " + y + "\n(rank 0 has " +
                  std::to_string(a.size()) + " parameters, rank " + std::to_string(r) + " has " +
                  std::to_string(b.size()) + "). Build the model identically on every rank.");
    }
  }
}

// Broadcasts tensors from `root`, flattened into one message per dtype/device.
void broadcast_coalesced(const Dist& d, const std::vector<at::Tensor>& tensors,
                         const std::string& what, int root) {
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (auto& t : tensors) {
    groups[std::string(c10::toString(t.scalar_type())) + t.device().str()].push_back(t);
  }
  for (auto& [key, ts] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : ts) flat_parts.push_back(t.detach().reshape({-1}));
    std::vector<at::Tensor> flat{at::cat(flat_parts)};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    wait_for(d.backend->broadcast(flat, bo),
             "broadcast of " + what + " from rank " + std::to_string(root), d);
    int64_t offset = 0;
    at::NoGradGuard no_grad;
    for (auto& t : ts) {
      t.copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace scaletrain
