#include "scaletrain/schedule.h"

#include <algorithm>
#include <deque>
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
    for (int i = 0; i < m; ++i) o.push_back({i, Pass::kForward});
    for (int i = m - 1; i >= 0; --i) o.push_back({i, Pass::kBackward});
  }
  return order;
}

std::vector<std::vector<PipeTask>> one_f_one_b_order(int p, int m) {
  check_counts(p, m);
  std::vector<std::vector<PipeTask>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<size_t>(s)];
    const int warmup = std::min(p - 1 - s, m);
    for (int i = 0; i < warmup; ++i) o.push_back({i, Pass::kForward});
    for (int i = 0; i + warmup < m; ++i) {
      o.push_back({warmup + i, Pass::kForward});
      o.push_back({i, Pass::kBackward});
    }
    for (int i = m - warmup; i < m; ++i) o.push_back({i, Pass::kBackward});
  }
  return order;
}

std::vector<std::vector<PipeTask>> interleaved_order(int p, int v, int m) {
  check_counts(p, m);
  if (v < 1) throw UsageError("an interleaved schedule needs at least 1 chunk per device");
  if (v == 1) return one_f_one_b_order(p, m);
  std::vector<std::vector<PipeTask>> order(static_cast<size_t>(p));
  if (m % p != 0) {
    // Not whole rounds (a short last batch): fill and drain, chunk by chunk — every forward of
    // chunk 0, of chunk 1, ..., then the backwards from the last chunk down.
    for (auto& o : order) {
      for (int c = 0; c < v; ++c) {
        for (int i = 0; i < m; ++i) o.push_back({i, Pass::kForward, c});
      }
      for (int c = v - 1; c >= 0; --c) {
        for (int i = m - 1; i >= 0; --i) o.push_back({i, Pass::kBackward, c});
      }
    }
    return order;
  }
  const int total = m * v;  // tasks of each direction per device
  // The k-th forward of a device: micro-batches in rounds of p per chunk, chunks in turn; the
  // k-th backward the same with the chunks from the last.
  auto nth = [&](int k, bool forward) {
    const int round = k / p, chunk = round % v;
    const int microbatch = (k / (p * v)) * p + k % p;
    return PipeTask{microbatch, forward ? Pass::kForward : Pass::kBackward,
                    forward ? chunk : v - 1 - chunk};
  };
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<size_t>(s)];
    const int warmup = std::min(2 * (p - 1 - s) + (v - 1) * p, total);
    int f = 0, b = 0;
    while (f < warmup) o.push_back(nth(f++, true));
    while (f < total) {
      o.push_back(nth(f++, true));
      o.push_back(nth(b++, false));
    }
    while (b < total) o.push_back(nth(b++, false));
  }
  return order;
}

std::vector<std::vector<PipeTask>> zero_bubble_h1_order(int p, int m) {
  check_counts(p, m);
  const auto P = static_cast<size_t>(p), M = static_cast<size_t>(m);
  // The tick at which each F and I ran, per stage and micro-batch (-1: not yet).
  std::vector<std::vector<int>> f_at(P, std::vector<int>(M, -1)), i_at = f_at;
  std::vector<int> next_f(P, 0), next_i(P, 0), live(P, 0);
  std::vector<std::deque<int>> pending_w(P);
  std::vector<std::vector<PipeTask>> order(P);
  size_t remaining = 3 * P * M;
  for (int tick = 0; remaining > 0; ++tick) {
    std::vector<std::optional<PipeTask>> row(P);
    auto before = [&](int at) { return at >= 0 && at < tick; };
    for (size_t s = 0; s < P; ++s) {
      const int cap = std::min(p, m);
      const int fi = next_f[s], ii = next_i[s];
      if (ii < m && before(f_at[s][static_cast<size_t>(ii)]) &&
          (s + 1 == P || before(i_at[s + 1][static_cast<size_t>(ii)]))) {
        row[s] = PipeTask{ii, Pass::kInputGrad};
      } else if (fi < m && live[s] < cap &&
                 (s == 0 || before(f_at[s - 1][static_cast<size_t>(fi)]))) {
        row[s] = PipeTask{fi, Pass::kForward};
      } else if (!pending_w[s].empty()) {
        row[s] = PipeTask{pending_w[s].front(), Pass::kWeightGrad};
      }
    }
    for (size_t s = 0; s < P; ++s) {
      if (!row[s]) continue;
      const PipeTask t = *row[s];
      const auto i = static_cast<size_t>(t.microbatch);
      if (t.pass == Pass::kForward) {
        f_at[s][i] = tick;
        ++next_f[s];
        ++live[s];
      } else if (t.pass == Pass::kInputGrad) {
        i_at[s][i] = tick;
        ++next_i[s];
        pending_w[s].push_back(t.microbatch);
      } else {
        pending_w[s].pop_front();
        --live[s];
      }
      order[s].push_back(t);
      --remaining;
    }
  }
  return order;
}

ScheduleTable schedule(const std::vector<std::vector<PipeTask>>& order) {
  const int p = static_cast<int>(order.size());
  int chunks = 1;
  for (const auto& o : order) {
    for (const auto& t : o) chunks = std::max(chunks, t.chunk + 1);
  }
  const int stages = p * chunks;
  // When each stage's forward, input gradient (B or I) and W of a micro-batch ran:
  // done[(stage, microbatch, kind)], kind 0 F, 1 B or I, 2 W.
  std::map<std::tuple<int, int, int>, int> done;
  auto kind = [](const PipeTask& t) { return t.forward() ? 0 : t.input_gradient() ? 1 : 2; };
  std::vector<size_t> next(order.size(), 0);
  ScheduleTable table;
  size_t remaining = 0;
  for (auto& o : order) remaining += o.size();
  for (int tick = 0; remaining > 0; ++tick) {
    std::vector<std::optional<PipeTask>> row(order.size());
    auto ready = [&](int k, int i, int what) {
      auto it = done.find({k, i, what});
      return it != done.end() && it->second < tick;
    };
    for (int s = 0; s < p; ++s) {
      const auto& o = order[static_cast<size_t>(s)];
      if (next[static_cast<size_t>(s)] >= o.size()) continue;
      const PipeTask t = o[next[static_cast<size_t>(s)]];
      const int k = t.chunk * p + s, i = t.microbatch;
      bool ok = t.forward()          ? (k == 0 || ready(k - 1, i, 0))
                : t.input_gradient() ? ready(k, i, 0) && (k == stages - 1 || ready(k + 1, i, 1))
                                     : ready(k, i, 1);
      if (ok) row[static_cast<size_t>(s)] = t;
    }
    bool any = false;
    for (int s = 0; s < p; ++s) {
      const auto& cell = row[static_cast<size_t>(s)];
      if (!cell) continue;
      any = true;
      done[{cell->chunk * p + s, cell->microbatch, kind(*cell)}] = tick;
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
ScheduleTable interleaved_schedule(int p, int v, int m) {
  return schedule(interleaved_order(p, v, m));
}
ScheduleTable zero_bubble_h1_schedule(int p, int m) { return schedule(zero_bubble_h1_order(p, m)); }

double bubble_fraction(int p, int m) {
  check_counts(p, m);
  return static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

double interleaved_bubble_fraction(int p, int v, int m) {
  check_counts(p, m);
  return static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
}

double zero_bubble_h1_bubble_fraction(int p, int m) {
  check_counts(p, m);
  return static_cast<double>(p - 1) / static_cast<double>(3 * m + p - 1);
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

int peak_in_flight(const ScheduleTable& table, int device) {
  int live = 0, peak = 0;
  for (auto& row : table) {
    const auto& cell = row[static_cast<size_t>(device)];
    if (!cell) continue;
    if (cell->forward()) ++live;
    if (cell->pass == Pass::kBackward || cell->pass == Pass::kWeightGrad) --live;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string draw(const ScheduleTable& table) {
  if (table.empty()) return "";
  bool chunks = false;
  for (auto& row : table) {
    for (auto& c : row) chunks = chunks || (c && c->chunk > 0);
  }
  std::ostringstream out;
  for (size_t s = 0; s < table[0].size(); ++s) {
    out << "s" << s;
    for (auto& row : table) {
      const auto& c = row[s];
      std::string cell = ".";
      if (c) {
        const char* letter[] = {"F", "B", "I", "W"};
        cell = letter[static_cast<int>(c->pass)] + std::to_string(c->microbatch);
        if (chunks) cell += "." + std::to_string(c->chunk);
      }
      out << " " << cell;
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace scaletrain
