#include "scaletrain/balance.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "scaletrain/error.h"

namespace scaletrain {

namespace {

std::string human(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / (1 << 30));
  } else if (bytes >= (1 << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

}  // namespace

Placement place_layers(const std::vector<int64_t>& layer_bytes,
                       const std::vector<DeviceBudget>& budgets) {
  if (budgets.empty()) throw UsageError("placement needs at least one device budget");
  // GPUs first, in the order given, then everything else (the CPU).
  std::vector<DeviceBudget> order;
  for (const auto& b : budgets) {
    if (b.device.rfind("cuda", 0) == 0) order.push_back(b);
  }
  for (const auto& b : budgets) {
    if (b.device.rfind("cuda", 0) != 0) order.push_back(b);
  }
  Placement p;
  size_t dev = 0, stage_of = order.size();  // the budget entry the current stage fills
  int64_t used = 0;
  for (size_t i = 0; i < layer_bytes.size(); ++i) {
    const int64_t need = layer_bytes[i];
    if (need < 0) throw UsageError("layer " + std::to_string(i) + " has a negative size");
    while (dev < order.size() && used + need > order[dev].bytes) {
      ++dev;
      used = 0;
    }
    if (dev == order.size()) {
      throw UsageError("layer " + std::to_string(i) + " (" + human(need) +
                       ") fits on none of the devices left after the earlier layers; give the "
                       "devices larger budgets or add one (e.g. the CPU)");
    }
    used += need;
    p.layer_device.push_back(order[dev].device);
    if (stage_of != dev) {  // a new budget entry: a new stage, even on a repeated device
      stage_of = dev;
      p.devices.push_back(order[dev].device);
      p.balance.push_back(0);
      p.stage_bytes.push_back(0);
    }
    ++p.balance.back();
    p.stage_bytes.back() += need;
  }
  return p;
}

std::string Placement::report() const {
  std::string out;
  int first = 0;
  for (size_t s = 0; s < devices.size(); ++s) {
    const int last = first + balance[s] - 1;
    out += devices[s] +
           (last > first ? ": layers " + std::to_string(first) + "-" + std::to_string(last)
                         : ": layer " + std::to_string(first)) +
           ", " + human(stage_bytes[s]) + "\n";
    first = last + 1;
  }
  return out;
}

std::vector<int> balance_by_cost(const std::vector<double>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  if (stages < 1 || n < stages) {
    throw UsageError("cannot split " + std::to_string(n) + " layers into " +
                     std::to_string(stages) + " stages: every stage needs at least one layer");
  }
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i)
    prefix[static_cast<size_t>(i) + 1] =
        prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  auto sum = [&](int a, int b) {
    return prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
  };
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest possible slowest stage when the first i layers form k stages;
  // cut[k][i]: where the k-th stage starts in that partition (the latest such start, which
  // keeps earlier stages fullest).
  std::vector<std::vector<double>> best(static_cast<size_t>(stages) + 1,
                                        std::vector<double>(static_cast<size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(static_cast<size_t>(stages) + 1,
                                    std::vector<int>(static_cast<size_t>(n) + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {
        double v = std::max(best[static_cast<size_t>(k) - 1][static_cast<size_t>(j)], sum(j, i));
        if (v <= best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = v;
          cut[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  std::vector<int> sizes(static_cast<size_t>(stages));
  for (int k = stages, i = n; k > 0; --k) {
    int j = cut[static_cast<size_t>(k)][static_cast<size_t>(i)];
    sizes[static_cast<size_t>(k) - 1] = i - j;
    i = j;
  }
  return sizes;
}

}  // namespace scaletrain
