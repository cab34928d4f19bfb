// Suite `context`: context parallelism on the zoo's GPT at a long context (ranks as threads of
// this process, Gloo, one intra-op thread each): per rank, the activation memory of one training
// step (counting_allocator.h: the largest rise of one rank's live bytes during the step, after a
// warm-up step) and the group's tokens per second, at cp 1 (one rank: the GPT as it trains
// without cp, scaled_dot_product_attention), cp 2 load-balanced and in order (2 ranks: ring
// attention), and cp 4 for the memory.
// Expectation: the activations of every layer hold S/N tokens per rank, and ring attention keeps
// no S² scores, so a rank's activations fall to about 1/N; the causal work per rank is a half at
// cp 2 when balanced (each rank the same number of (query, key) pairs), so 2 ranks do a step in a
// little over half the single rank's time, less the hops; in order, rank 1 does 3/4 of it and
// the step waits for it.

#include <ATen/Parallel.h>

#include <algorithm>

#include "counting_allocator.h"
#include "gpt.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

struct CpCase {
  std::string name;
  int cp;
  bool balanced, timed;
};

struct CpFigures {
  double mib = 0, seconds = 0;  // the fullest rank's activations, the slowest rank's step
};

// One rank: a warm-up step, the measured step (memory, between barriers), then `repeats` timed
// steps (the best; each between barriers, so the slowest rank sets it). Rank 0 writes `out`.
void cp_rank(const CpCase& c, const GPTConfig& g, int64_t batch, int repeats, int rank, Dist& d,
             CountingAllocator& counting, CpFigures& out) {
  torch::manual_seed(0);
  GPT m(g);
  const ContextSplit split{c.cp, rank, c.balanced};
  if (c.cp > 1) m->context_parallel(&d, split);
  torch::manual_seed(1);
  auto data = at::randint(g.vocab_size, {batch, g.block_size + 1}, at::kLong);
  const auto x = split.shard(data.narrow(1, 0, g.block_size), 1);
  const auto y = split.shard(data.narrow(1, 1, g.block_size), 1);
  auto step = [&] {
    m->zero_grad(/*set_to_none=*/false);
    m->loss(m->forward(x), y).backward();
  };
  step();  // the gradients exist from here on
  d.barrier("context warm-up");
  if (rank == 0) counting.reset_peak();
  d.barrier("context start");
  step();
  d.barrier("context end");
  if (!c.timed) return;
  double best = 1e30;
  for (int k = 0; k < repeats; ++k) {
    d.barrier("context timed start");
    const auto t0 = std::chrono::steady_clock::now();
    step();
    d.barrier("context timed end");
    best = std::min(best, seconds_since(t0));
  }
  if (rank == 0) out.seconds = best;
}

CpFigures cp_measure(const CpCase& c, const GPTConfig& g, int64_t batch, int repeats,
                     CountingAllocator& counting) {
  CpFigures out;
  run_thread_ranks(
      c.cp, [&](int rank, Dist& d) { cp_rank(c, g, batch, repeats, rank, d, counting, out); });
  out.mib = static_cast<double>(counting.peak_of_fullest_thread()) / (1 << 20);
  return out;
}

}  // namespace

SuiteResult run_context(const SuiteOptions& o) {
  const std::string title = "GPT at a long context: activation memory per rank and tokens/s, cp";
  SuiteResult r =
      new_result("context", title, "MiB, tokens/s",
                 {Plot::Kind::kBars, title, "", "MiB per rank | tokens/s", false, false}, o);
  GPTConfig g;
  g.vocab_size = 512;
  g.n_layer = 2;
  g.n_head = 4;
  g.n_embd = 128;
  g.block_size = o.quick ? 1024 : 4096;
  g.tied_head = false;
  const int64_t batch = 1;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // each rank's work (and its allocations) on its own thread
  CountingScope scope;
  const std::vector<CpCase> cases = {{"cp 1", 1, true, true},
                                     {"cp 2", 2, true, true},
                                     {"cp 2 in order", 2, false, true},
                                     {"cp 4", 4, true, false}};
  std::map<std::string, CpFigures> first;
  for (const auto& c : cases) {
    Sample mem{"cpu", c.name + ": MiB per rank", 0, {}};
    Sample speed{"cpu", c.name + ": tokens/s", 0, {}};
    for (int rep = 0; rep < o.repeats; ++rep) {
      const CpFigures f = cp_measure(c, g, batch, o.quick ? 2 : 3, scope.counter());
      mem.values.push_back(f.mib);
      if (c.timed) speed.values.push_back(static_cast<double>(batch * g.block_size) / f.seconds);
      if (rep == 0) first[c.name] = f;
    }
    r.samples.push_back(mem);
    if (c.timed) r.samples.push_back(speed);
  }
  at::set_num_threads(threads);
  r.notes.push_back("GPT: " + std::to_string(g.n_layer) + " layers, " + std::to_string(g.n_head) +
                    " heads, " + std::to_string(g.n_embd) + " wide, context " +
                    std::to_string(g.block_size) + ", vocabulary " + std::to_string(g.vocab_size) +
                    ", untied head, fp32, no dropout; " + std::to_string(batch) +
                    " sequence a step; one forward and backward; each rank one thread (cp 1: one "
                    "core, cp 2: two).");
  const double one = first["cp 1"].mib, t1 = first["cp 1"].seconds;
  r.notes.push_back("Activations per rank against cp 1: cp 2 " + fixed(first["cp 2"].mib / one) +
                    ", cp 4 " + fixed(first["cp 4"].mib / one) +
                    " (target at cp 2: 0.55 or less).");
  r.notes.push_back("Tokens/s against cp 1 on one rank: cp 2 on two ranks " +
                    fixed(t1 / first["cp 2"].seconds) + "x balanced, " +
                    fixed(t1 / first["cp 2 in order"].seconds) +
                    "x in order (target balanced: 1.6x or more).");
  return r;
}

}  // namespace scaletrain::bench
