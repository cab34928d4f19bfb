// Suite `transformer-memory`: the activation memory of one training step of the zoo's GPT per
// rank, measured (counting_allocator.h: the peak of the bytes of live tensors above what the
// weights and gradients hold after a warm-up step, per rank's thread), on one rank and split
// over a tensor-parallel group of 2 (ranks as threads of this process, Gloo), with sequence
// parallelism and with each block recomputed in backward (activation_checkpoint.h).
// Expectation (Korthikanti et al. 2022): tensor parallelism splits the attention's and the
// MLP's inner activations but leaves the LayerNorms', the residuals' and the block inputs whole
// on each rank, so a rank holds more than half of the single rank's; sequence parallelism
// splits those too, about halving it; recomputation keeps each block's input only.

#include <ATen/Parallel.h>

#include "counting_allocator.h"
#include "gpt.h"
#include "scaletrain/dist.h"
#include "scaletrain/error.h"
#include "suites_internal.h"

namespace scaletrain::bench {
namespace {

struct Case {
  std::string name;
  int tp;
  bool sequence_parallel, recompute;
};

// One rank of a case: a warm-up step, then the measured one (between barriers, so that the
// counts start when every rank is idle).
void rank_step(const Case& c, const GPTConfig& base, int64_t batch, int rank, Dist& d,
               CountingAllocator& counting) {
  GPTConfig g = base;
  g.checkpoint_blocks = c.recompute;
  torch::manual_seed(0);
  GPT m(g);
  if (c.tp > 1) m->parallelize(d, c.sequence_parallel);
  torch::manual_seed(1);
  auto data = at::randint(g.vocab_size, {batch, g.block_size + 1}, at::kLong);
  auto x = data.narrow(1, 0, g.block_size).contiguous();
  auto y = data.narrow(1, 1, g.block_size).contiguous();
  auto step = [&] {
    m->zero_grad(/*set_to_none=*/false);
    m->loss(m->forward(x), y).backward();
  };
  step();  // the gradients exist from here on
  d.barrier("transformer-memory warm-up");
  if (rank == 0) counting.reset_peak();
  d.barrier("transformer-memory start");
  step();
  d.barrier("transformer-memory end");
}

// The fullest rank's peak activation bytes of one step.
double measure(const Case& c, const GPTConfig& g, int64_t batch, CountingAllocator& counting) {
  run_thread_ranks(c.tp, [&](int rank, Dist& d) { rank_step(c, g, batch, rank, d, counting); });
  return static_cast<double>(counting.peak_of_fullest_thread()) / (1 << 20);
}

}  // namespace

SuiteResult run_transformer_memory(const SuiteOptions& o) {
  const std::string title = "GPT activation memory per rank: tensor, sequence parallel, recompute";
  SuiteResult r =
      new_result("transformer-memory", title, "MiB",
                 {Plot::Kind::kBars, title, "", "peak activation MiB per rank", false, false}, o);
  GPTConfig g;
  g.vocab_size = 512;
  g.n_layer = o.quick ? 2 : 4;
  g.n_head = 8;
  g.n_embd = o.quick ? 128 : 256;
  g.block_size = o.quick ? 64 : 256;
  g.tied_head = false;
  const int64_t batch = o.quick ? 2 : 8;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // each rank's work (and its allocations) on its own thread
  CountingScope scope;
  const std::vector<Case> cases = {{"1 rank", 1, false, false},
                                   {"1 rank, recompute", 1, false, true},
                                   {"tp 2", 2, false, false},
                                   {"tp 2 + sequence parallel", 2, true, false},
                                   {"tp 2 + sequence parallel + recompute", 2, true, true}};
  std::map<std::string, double> mean;
  for (const auto& c : cases) {
    Sample s{"cpu", c.name, 0, {}};
    for (int rep = 0; rep < o.repeats; ++rep)
      s.values.push_back(measure(c, g, batch, scope.counter()));
    mean[c.name] = s.values.front();
    r.samples.push_back(s);
  }
  at::set_num_threads(threads);
  r.notes.push_back("GPT: " + std::to_string(g.n_layer) + " layers, " + std::to_string(g.n_head) +
                    " heads, " + std::to_string(g.n_embd) + " wide, context " +
                    std::to_string(g.block_size) + ", vocabulary " + std::to_string(g.vocab_size) +
                    ", untied head, fp32, no dropout; a batch of " + std::to_string(batch) +
                    " sequences; one forward and backward.");
  char line[256];
  std::snprintf(line, sizeof(line),
                "Per rank against one rank: tp 2 %.2f, tp 2 + sequence parallel %.2f; "
                "recompute on one rank %.2f, on tp 2 + sequence parallel %.2f of the single rank.",
                mean["tp 2"] / mean["1 rank"], mean["tp 2 + sequence parallel"] / mean["1 rank"],
                mean["1 rank, recompute"] / mean["1 rank"],
                mean["tp 2 + sequence parallel + recompute"] / mean["1 rank"]);
  r.notes.push_back(line);
  return r;
}

}  // namespace scaletrain::bench
