#include "scaletrain/placement.h"

#include <algorithm>
#include <cstdio>

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

}  // namespace scaletrain
