#include "scaletrain/bucket.h"

#include <algorithm>
#include <map>

#include "scaletrain/error.h"

namespace scaletrain {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const BucketOptions& options) {
  if (options.first_cap_bytes <= 0 || options.cap_bytes <= 0) {
    throw UsageError("bucket caps must be positive (first " +
                     std::to_string(options.first_cap_bytes) + " bytes, then " +
                     std::to_string(options.cap_bytes) + " bytes)");
  }
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
  };
  std::map<std::string, Open> open;      // one open bucket per group
  std::vector<std::string> group_order;  // groups in the order they first appeared
  std::vector<std::vector<size_t>> done;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    if (std::find(group_order.begin(), group_order.end(), p.group) == group_order.end()) {
      group_order.push_back(p.group);
    }
    Open& b = open[p.group];
    b.indices.push_back(k);
    b.bytes += p.bytes;
    const int64_t cap = done.empty() ? options.first_cap_bytes : options.cap_bytes;
    if (b.bytes >= cap) {
      done.push_back(std::move(b.indices));
      open.erase(p.group);
    }
  }
  for (auto& g : group_order) {
    auto it = open.find(g);
    if (it != open.end() && !it->second.indices.empty()) done.push_back(it->second.indices);
  }
  return done;
}

}  // namespace scaletrain
