#include "scaletrain/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

void check_counts(int stages, int microbatches) {
  if (stages < 1 || microbatches < 1) {
    throw UsageError("a pipeline needs at least 1 stage and 1 micro-batch (got " +
                     std::to_string(stages) + " stages, " + std::to_string(microbatches) +
                     " micro-batches)");
  }
}

}  // namespace

std::vector<std::vector<PipeTask>> gpipe_order(int p, int m) {
  check_counts(p, m);
  std::vector<std::vector<PipeTask>> order(static_cast<size_t>(p));
  for (auto& o : order) {
    for (int i = 0; i < m; ++i) o.push_back({i, true});
    for (int i = m - 1; i >= 0; --i) o.push_back({i, false});
  }
  return order;
}

std::vector<std::vector<PipeTask>> one_f_one_b_order(int p, int m) {
  check_counts(p, m);
  std::vector<std::vector<PipeTask>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<size_t>(s)];
    const int warmup = std::min(p - 1 - s, m);
    for (int i = 0; i < warmup; ++i) o.push_back({i, true});
    for (int i = 0; i + warmup < m; ++i) {
      o.push_back({warmup + i, true});
      o.push_back({i, false});
    }
    for (int i = m - warmup; i < m; ++i) o.push_back({i, false});
  }
  return order;
}

ScheduleTable schedule(const std::vector<std::vector<PipeTask>>& order) {
  const int p = static_cast<int>(order.size());
  // done[(stage, microbatch, forward)] = the tick it ran at.
  std::map<std::tuple<int, int, bool>, int> done;
  std::vector<size_t> next(order.size(), 0);
  ScheduleTable table;
  size_t remaining = 0;
  for (auto& o : order) remaining += o.size();
  for (int tick = 0; remaining > 0; ++tick) {
    std::vector<std::optional<PipeTask>> row(order.size());
    auto ready = [&](int s, int i, bool f) {
      auto it = done.find({s, i, f});
      return it != done.end() && it->second < tick;
    };
    for (int s = 0; s < p; ++s) {
      const auto& o = order[static_cast<size_t>(s)];
      if (next[static_cast<size_t>(s)] >= o.size()) continue;
      const PipeTask t = o[next[static_cast<size_t>(s)]];
      bool ok = t.forward ? (s == 0 || ready(s - 1, t.microbatch, true))
                          : (ready(s, t.microbatch, true) &&
                             (s == p - 1 || ready(s + 1, t.microbatch, false)));
      if (ok) row[static_cast<size_t>(s)] = t;
    }
    bool any = false;
    for (int s = 0; s < p; ++s) {
      if (!row[static_cast<size_t>(s)]) continue;
      any = true;
      done[{s, row[static_cast<size_t>(s)]->microbatch, row[static_cast<size_t>(s)]->forward}] =
          tick;
      ++next[static_cast<size_t>(s)];
      --remaining;
    }
    if (!any) throw Error("pipeline schedule deadlocks at tick " + std::to_string(tick));
    table.push_back(row);
  }
  return table;
}

ScheduleTable gpipe_schedule(int p, int m) { return schedule(gpipe_order(p, m)); }
ScheduleTable one_f_one_b_schedule(int p, int m) { return schedule(one_f_one_b_order(p, m)); }

double bubble_fraction(int p, int m) {
  check_counts(p, m);
  return static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

double idle_fraction(const ScheduleTable& table) {
  size_t idle = 0, all = 0;
  for (auto& row : table) {
    for (auto& cell : row) {
      ++all;
      idle += cell ? 0 : 1;
    }
  }
  return all ? static_cast<double>(idle) / static_cast<double>(all) : 0;
}

int peak_in_flight(const ScheduleTable& table, int stage) {
  int live = 0, peak = 0;
  for (auto& row : table) {
    const auto& cell = row[static_cast<size_t>(stage)];
    if (!cell) continue;
    live += cell->forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string draw(const ScheduleTable& table) {
  if (table.empty()) return "";
  std::ostringstream out;
  for (size_t s = 0; s < table[0].size(); ++s) {
    out << "s" << s;
    for (auto& row : table) {
      const auto& c = row[s];
      std::string cell = c ? (c->forward ? "F" : "B") + std::to_string(c->microbatch) : ".";
      out << " " << cell;
    }
    out << "\n";
  }
  return out.str();
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
