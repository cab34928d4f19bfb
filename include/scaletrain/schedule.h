#pragma once
// Pipeline planning as pure functions of counts and costs: no devices, no threads. The runners
// (Pipeline in pipeline.h, DistPipeline in dist_pipeline.h) execute the per-stage orders these
// tables give, so a schedule is checked here, against tables drawn by hand, before any tensor
// moves (tests/schedule_test.cpp).
//
// A schedule is built from one ordered list of tasks per stage (GPipe: all forwards, then all
// backwards in reverse; 1F1B: a few forwards, then one forward / one backward alternately) and
// the dependencies of a pipeline: F(i) on stage s needs F(i) on stage s-1, B(i) on stage s needs
// F(i) on s and B(i) on s+1. Each task takes one tick; a stage runs its next task as soon as
// the task's inputs were produced in an earlier tick. p stages, m micro-batches:
//
//   GPipe, p=2, m=3                    1F1B, p=2, m=3
//   tick  0  1  2  3  4  5  6  7       tick  0  1  2  3  4  5  6  7
//   s0   F0 F1 F2 .  .  B2 B1 B0       s0   F0 F1 .  B0 F2 B1 .  B2
//   s1   .  F0 F1 F2 B2 B1 B0 .        s1   .  F0 B0 F1 B1 F2 B2 .

#include <optional>
#include <string>
#include <vector>

namespace scaletrain {

struct PipeTask {
  int microbatch = 0;
  bool forward = true;
  bool operator==(const PipeTask& o) const {
    return microbatch == o.microbatch && forward == o.forward;
  }
};

/// table[tick][stage]: the task a stage runs at that tick, or nothing (a bubble).
using ScheduleTable = std::vector<std::vector<std::optional<PipeTask>>>;

/// Per-stage task orders.
std::vector<std::vector<PipeTask>> gpipe_order(int stages, int microbatches);
std::vector<std::vector<PipeTask>> one_f_one_b_order(int stages, int microbatches);

/// The tick table of a per-stage order under the pipeline's dependencies. Throws Error when the
/// order deadlocks (a task waits for one that can never run).
ScheduleTable schedule(const std::vector<std::vector<PipeTask>>& order);

/// Convenience: schedule(gpipe_order(...)), schedule(one_f_one_b_order(...)).
ScheduleTable gpipe_schedule(int stages, int microbatches);
ScheduleTable one_f_one_b_schedule(int stages, int microbatches);

/// The theoretical bubble fraction of a fill-drain pipeline: (p-1)/(m+p-1).
double bubble_fraction(int stages, int microbatches);
/// The idle fraction of a table: idle stage-ticks / all stage-ticks.
double idle_fraction(const ScheduleTable& table);
/// Largest number of micro-batches whose activations a stage holds at once (forwarded, not yet
/// backwarded): GPipe holds m, 1F1B at most p - s.
int peak_in_flight(const ScheduleTable& table, int stage);

/// The drawing used in comments and tests: one row per stage, "F3", "B0" or "." per tick.
std::string draw(const ScheduleTable& table);

/// Contiguous partition of layers into `stages` minimising the most expensive stage (costs:
/// measured time, or parameter sizes). Returns layers per stage, each at least 1. Among equally
/// good partitions, the one whose earlier stages are fullest. Throws UsageError when there are
/// fewer layers than stages.
std::vector<int> balance_by_cost(const std::vector<double>& costs, int stages);

}  // namespace scaletrain
