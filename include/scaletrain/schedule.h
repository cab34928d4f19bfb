#pragma once
// Pipeline planning as pure functions of counts and costs: no devices, no threads. The runners
// (Pipeline in pipeline.h, DistPipeline in dist_pipeline.h) execute the per-device orders these
// tables give, so a schedule is checked here, against tables drawn by hand, before any tensor
// moves (tests/schedule_test.cpp).
//
// A schedule is built from one ordered list of tasks per device and the dependencies of a
// pipeline over its stages: F(i) on stage k needs F(i) on stage k-1; B(i) (a whole backward) or
// I(i) (its input-gradient half) on stage k needs F(i) on k and the input gradient of stage
// k+1; W(i) (the weight-gradient half) needs I(i) on its own stage. Each task takes one tick; a
// device runs its next task as soon as the task's inputs were produced in an earlier tick. p
// devices, m micro-batches:
//
//   GPipe, p=2, m=3                    1F1B, p=2, m=3
//   tick  0  1  2  3  4  5  6  7       tick  0  1  2  3  4  5  6  7
//   s0   F0 F1 F2 .  .  B2 B1 B0       s0   F0 F1 .  B0 F2 B1 .  B2
//   s1   .  F0 F1 F2 B2 B1 B0 .        s1   .  F0 B0 F1 B1 F2 B2 .
//
// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM) gives each device v stages ("chunks"):
// stage k lives on device k mod p as its chunk k / p, so a micro-batch crosses every device v
// times and the fill and drain take 1/v as long: bubble (p-1)/(v·m + p-1) of the ticks, each
// tick 1/v of a stage's work. Zero bubble H1 (Qi et al. 2023) splits each backward into I and
// W and runs the W's, which nothing waits for, in the ticks where 1F1B idles: with F, I and W
// of equal cost, bubble (p-1)/(3m + p-1) at 1F1B's activation memory.

#include <optional>
#include <string>
#include <vector>

namespace scaletrain {

/// F: forward; B: a whole backward; I and W: a backward's input-gradient and weight-gradient
/// halves (zero-bubble schedules run both, in that order, for each micro-batch and stage).
enum class Pass : unsigned char { kForward, kBackward, kInputGrad, kWeightGrad };

struct PipeTask {
  int microbatch = 0;
  Pass pass = Pass::kForward;
  int chunk = 0;  // which of the device's stages (interleaved schedules; 0 otherwise)
  bool forward() const { return pass == Pass::kForward; }
  /// B or I: the task that produces the stage's input gradient.
  bool input_gradient() const { return pass == Pass::kBackward || pass == Pass::kInputGrad; }
  bool operator==(const PipeTask& o) const {
    return microbatch == o.microbatch && pass == o.pass && chunk == o.chunk;
  }
};

/// table[tick][device]: the task a device runs at that tick, or nothing (a bubble).
using ScheduleTable = std::vector<std::vector<std::optional<PipeTask>>>;

/// Per-device task orders.
std::vector<std::vector<PipeTask>> gpipe_order(int stages, int microbatches);
std::vector<std::vector<PipeTask>> one_f_one_b_order(int stages, int microbatches);
/// Interleaved 1F1B over `devices` devices of `chunks` stages each (Megatron-LM's order:
/// forwards in rounds of `devices` micro-batches per chunk, warm-up 2(p-1-s) + (v-1)p
/// forwards on device s) when microbatches is a multiple of devices; otherwise (a short last
/// batch) a fill-drain order over the chunks, every forward of chunk 0, then of chunk 1, ...,
/// then the backwards from the last chunk down. chunks 1 is one_f_one_b_order.
std::vector<std::vector<PipeTask>> interleaved_order(int devices, int chunks, int microbatches);
/// Zero bubble H1: no stage holds more micro-batches in flight (from F to W) than 1F1B's first
/// stage does (p), and at every tick each runs, of what is ready, an I first, then an F within
/// that limit, then the oldest W: the W's fill what would be 1F1B's bubbles. With F, I and W of
/// equal cost the table is 3m + p - 1 ticks long (the theory) when m = p, and at most ⌈p/2⌉
/// ticks longer otherwise (a greedy order, not a search).
std::vector<std::vector<PipeTask>> zero_bubble_h1_order(int stages, int microbatches);

/// The tick table of a per-stage order under the pipeline's dependencies. Throws Error when the
/// order deadlocks (a task waits for one that can never run).
ScheduleTable schedule(const std::vector<std::vector<PipeTask>>& order);

/// Convenience: schedule(gpipe_order(...)), and so on.
ScheduleTable gpipe_schedule(int stages, int microbatches);
ScheduleTable one_f_one_b_schedule(int stages, int microbatches);
ScheduleTable interleaved_schedule(int devices, int chunks, int microbatches);
ScheduleTable zero_bubble_h1_schedule(int stages, int microbatches);

/// The theoretical bubble fraction of a fill-drain pipeline: (p-1)/(m+p-1).
double bubble_fraction(int stages, int microbatches);
/// Interleaved 1F1B's: (p-1)/(v·m + p-1) (Megatron-LM's (p-1)/(v·m) of the ideal time).
double interleaved_bubble_fraction(int devices, int chunks, int microbatches);
/// Zero bubble H1's with F, I and W of equal cost: (p-1)/(3m + p-1).
double zero_bubble_h1_bubble_fraction(int stages, int microbatches);
/// The idle fraction of a table: idle device-ticks / all device-ticks.
double idle_fraction(const ScheduleTable& table);
/// Largest number of micro-batches whose activations a device holds at once (forwarded, their
/// B or W not run yet), over all its chunks: GPipe holds m, 1F1B at most p - s.
int peak_in_flight(const ScheduleTable& table, int device);

/// The drawing used in comments and tests: one row per device, "F3", "B0", "I1", "W1" or "."
/// per tick; with chunks, each task's chunk after a dot ("F3.1").
std::string draw(const ScheduleTable& table);

}  // namespace scaletrain
