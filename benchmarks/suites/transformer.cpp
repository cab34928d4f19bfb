// Suite `transformer`: the zoo's GPT (zoo/gpt.h, nanoGPT's layout, an untied head) trained
// with AdamW on 2 and 4 local CPU processes, one intra-op thread each, each configuration beside
// PyTorch's own Python path on the same architecture (benchmarks/python/transformer_peer.py, the
// same torch from the project's .venv, launched the same way in the same run):
//
//   ddp      2  scaletrain's DistributedDataParallel  | torch's DistributedDataParallel
//   tp       2  GPT::parallelize (Megatron's plan),   | parallelize_module with ColwiseParallel
//               the vocabulary-parallel cross entropy |   and RowwiseParallel, loss_parallel()
//   tp-sp    2  the same with sequence parallelism    | the same with SequenceParallel on the
//                                                     |   LayerNorms
//   tp       4  the plan over 4 ranks                 | the same over 4 ranks
//   fsdp     4  ShardedDataParallel, stage 3, a unit  | FSDP2: fully_shard on every block, then
//               per block                             |   on the model
//   fsdp-tp  4  2D, mesh {dp: 2, tp: 2}: the plan     | the plan on the mesh's "tp", FSDP2 on
//               over tp, stage 3 over dp              |   its "dp"
//   pp-tp    4  mesh {pp: 2, tp: 2}: the plan over    | the plan on the mesh's "tp", the model
//               tp, the chain in two DistPipeline     |   in two PipelineStages over its "pp"
//               stages, 1F1B over --chunks            |   (torch.distributed.pipelining),
//               micro-batches                         |   Schedule1F1B, loss_parallel()
//
// Suite `llama`: the same configurations with the zoo's Llama (zoo/llama.h: RMSNorm, rotary
// embeddings, grouped-query attention, SwiGLU, an untied head) on both sides; the plan splits
// q/k/v/gate/up by columns and o/down by rows (the key/value heads over the ranks), sequence
// parallelism covers the RMSNorms.
//
// The global batch, steps, data shape and optimizer are the same on both sides. Each launch
// reports the median of its timed steps (after warm-up) as tokens/s and every rank's peak
// resident memory. Rounds alternate which side goes first, so that the machine's drift hits
// both alike.

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>  // models/gpt.h uses it without including it
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include "gpt.h"
#include "llama.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"
#include "scaletrain/mesh.h"
#include "scaletrain/zero.h"
#include "suites_internal.h"
#include "zoo_models.h"

namespace scaletrain::bench {
namespace {

// The model and the run's size, as the worker and the Python peer take them.
struct RunSize {
  std::string arch = "gpt";  // or "llama"
  GPTConfig gpt;             // the GPT's, and for a Llama its layers, heads, width, context, vocab
  int64_t kv_heads = 0, intermediate = 0;  // a Llama's
  int64_t batch = 4;                       // global, sequences of gpt.block_size tokens
  int steps = 20, warmup = 3;
  int chunks = 4;  // pp-tp: micro-batches per step
};

RunSize size_of(const std::map<std::string, std::string>& kv) {
  RunSize s;
  s.gpt.n_layer = std::stoll(arg_or(kv, "--layers", "4"));
  s.gpt.n_head = std::stoll(arg_or(kv, "--heads", "8"));
  s.gpt.n_embd = std::stoll(arg_or(kv, "--width", "256"));
  s.gpt.block_size = std::stoll(arg_or(kv, "--context", "128"));
  s.gpt.vocab_size = std::stoll(arg_or(kv, "--vocab", "512"));
  s.gpt.tied_head = false;  // every strategy can split an untied head (the zoo's choice)
  s.arch = arg_or(kv, "--arch", "gpt");
  s.kv_heads = std::stoll(arg_or(kv, "--kv-heads", "0"));
  s.intermediate = std::stoll(arg_or(kv, "--intermediate", "0"));
  s.batch = std::stoll(arg_or(kv, "--batch-size", "4"));
  s.steps = std::stoi(arg_or(kv, "--steps", "20"));
  s.warmup = std::stoi(arg_or(kv, "--warmup", "3"));
  s.chunks = std::stoi(arg_or(kv, "--chunks", "4"));
  return s;
}

std::vector<std::string> size_args(const RunSize& s) {
  const GPTConfig& c = s.gpt;
  return {
      "--layers",   std::to_string(c.n_layer),    "--heads",        std::to_string(c.n_head),
      "--width",    std::to_string(c.n_embd),     "--context",      std::to_string(c.block_size),
      "--vocab",    std::to_string(c.vocab_size), "--batch-size",   std::to_string(s.batch),
      "--steps",    std::to_string(s.steps),      "--warmup",       std::to_string(s.warmup),
      "--chunks",   std::to_string(s.chunks),     "--arch",         s.arch,
      "--kv-heads", std::to_string(s.kv_heads),   "--intermediate", std::to_string(s.intermediate)};
}

LlamaConfig llama_of(const RunSize& s) {
  LlamaConfig c;
  c.vocab_size = s.gpt.vocab_size, c.hidden_size = s.gpt.n_embd;
  c.intermediate_size = s.intermediate, c.n_layers = s.gpt.n_layer;
  c.n_heads = s.gpt.n_head, c.n_kv_heads = s.kv_heads, c.max_positions = s.gpt.block_size;
  return c;
}

// The run's model as the library's Model (zoo_models.h), whatever the architecture.
Model bench_model(const RunSize& s) {
  return s.arch == "llama" ? llama_model(s.arch, llama_of(s)) : gpt_model(s.arch, s.gpt);
}

// Rank 0 writes what the Python peer writes: `step,s` per timed step, `rss,rank,bytes` per rank,
// `params,n`, `loss,x`.
void write_worker_csv(const Dist& d, const std::string& path, const std::vector<double>& times,
                      int64_t params, double loss) {
  auto rss = d.all_gather(at::full({1}, peak_rss(), at::kLong), "peak RSS");
  if (d.rank() != 0) return;
  std::ofstream csv(path);
  for (double t : times) csv << "step," << t << "\n";
  for (size_t r = 0; r < rss.size(); ++r)
    csv << "rss," << r << "," << rss[r].item<int64_t>() << "\n";
  csv << "params," << params << "\nloss," << loss << "\n";
  if (!csv) throw Error("transformer worker: cannot write " + path);
}

}  // namespace

// The data-parallel degree of a mode on `world` ranks: the replicas the batch splits over.
static int replicas_of(const std::string& mode, int world) {
  if (mode == "ddp" || mode == "fsdp") return world;
  return mode == "fsdp-tp" ? world / 2 : 1;
}

// pp-tp: the mesh {pp: 2, tp: 2}; the plan over "tp", the model's chain cut in two stages (the
// embeddings and the first half of the blocks; the second half and the head), 1F1B over the
// pipeline. The tp ranks of a stage run the same tasks, so their collectives meet.
class TwoStages {
 public:
  TwoStages(Model& m, const Dist& d, int chunks) : m_(m), d_(d) {
    if (d.size() != 4) {
      throw UsageError("transformer worker: pp-tp runs on 4 ranks (pp 2 x tp 2), not " +
                       std::to_string(d.size()));
    }
    const DeviceMesh mesh({{"pp", 2}, {"tp", 2}}, d.size());
    tp_ = mesh_groups(d, mesh, "transformer", {"tp"}).at("tp");
    m.parallelize(tp_, false);
    auto chain = m.blocks();
    const size_t half = chain->size() / 2;  // embed, h0 .. h(L/2-1) | h(L/2) .. h(L-1), head
    stage_ = mesh.coordinate(d.rank(), "pp");
    DistPipelineOptions po;
    po.stage_ranks = mesh.group(d.rank(), "pp");
    po.chunks = chunks;
    po.schedule = PipelineSchedule::k1F1B;
    pipe_ = std::make_unique<DistPipeline>(
        stage_ == 0 ? slice(chain, 0, half) : slice(chain, half, chain->size()), po, d);
  }
  std::vector<at::Tensor> parameters() { return pipe_->module()->parameters(); }
  // The batch's loss on every rank (from the last stage's tp rank 0, rank 2).
  double step(const at::Tensor& x, const at::Tensor& y) {
    auto loss = pipe_->train_step(
        stage_ == 0 ? x : at::Tensor(), stage_ == 1 ? y : at::Tensor(),
        [&](const at::Tensor& out, const at::Tensor& t) { return m_.parallel_loss(out, t); });
    auto t = at::zeros({1}, at::kDouble);
    if (loss.defined()) t.fill_(loss.item<double>());
    d_.broadcast(t, 2);
    return t.item<double>();
  }

 private:
  Model& m_;
  const Dist& d_;
  Dist tp_;
  int stage_ = 0;
  std::unique_ptr<DistPipeline> pipe_;
};

namespace {

void check_mode(const std::string& mode) {
  if (mode != "ddp" && mode != "tp" && mode != "tp-sp" && mode != "fsdp" && mode != "fsdp-tp" &&
      mode != "pp-tp") {
    throw UsageError("transformer worker: --mode " + mode +
                     "; use ddp, tp, tp-sp, fsdp, fsdp-tp or pp-tp");
  }
}

// The model as the mode trains it: at most one wrapper (tp and tp-sp parallelize the model
// itself and keep none).
struct Wrappers {
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<ShardedDataParallel> fsdp;
  std::unique_ptr<TwoStages> pipe;
};

Wrappers wrap_for_mode(const std::string& mode, Model& m, Dist& d, int dp, int chunks) {
  Wrappers w;
  ShardOptions so;
  so.stage = 3;
  so.unit_cap_mb = 0.001;  // a unit per block, as FSDP2's fully_shard per block
  if (mode == "ddp") {
    w.ddp = std::make_unique<DistributedDataParallel>(m.module, d);
  } else if (mode == "fsdp") {
    w.fsdp = std::make_unique<ShardedDataParallel>(m.blocks(), d, so);
  } else if (mode == "fsdp-tp") {
    const DeviceMesh mesh({{"dp", dp}, {"tp", 2}}, d.size());
    auto groups = mesh_groups(d, mesh, "transformer");
    m.parallelize(groups.at("tp"), false);
    w.fsdp = std::make_unique<ShardedDataParallel>(m.blocks(), groups.at("dp"), so);
  } else if (mode == "pp-tp") {
    w.pipe = std::make_unique<TwoStages>(m, d, chunks);
  } else {
    m.parallelize(d, mode == "tp-sp");  // the tensor-parallel group is the whole world
  }
  return w;
}

}  // namespace

int run_transformer_worker(const std::vector<std::string>& args) {
  auto kv = parse_kv(args);
  const std::string mode = arg_or(kv, "--mode", "ddp");
  check_mode(mode);
  const RunSize s = size_of(kv);
  Dist d = init_process_group();
  at::set_num_threads(1);
  torch::manual_seed(0);
  Model m = bench_model(s);
  const int64_t params = parameter_count(*m.module);
  const int dp = replicas_of(mode, d.size());
  if (s.batch % dp != 0) {
    throw UsageError("transformer worker: a global batch of " + std::to_string(s.batch) +
                     " sequences does not split over " + std::to_string(dp) +
                     " replicas; use a multiple of them");
  }
  Wrappers wrapped = wrap_for_mode(mode, m, d, dp, s.chunks);
  auto& ddp = wrapped.ddp;
  auto& fsdp = wrapped.fsdp;
  auto& pipe = wrapped.pipe;
  // Sequence parallelism's partial sums once per step, as train() does (defer_partial_sums()).
  const std::vector<at::Tensor> partial =
      mode == "tp-sp" ? replicated_parameters(*m.module) : std::vector<at::Tensor>{};
  defer_partial_sums(partial);
  torch::optim::AdamW opt(fsdp   ? fsdp->parameters()
                          : pipe ? pipe->parameters()
                                 : m.module->parameters(),
                          torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  // Random tokens: each replica its own part of the batch, the same rows on every rank of a
  // tensor-parallel group (consecutive ranks, dp outer).
  torch::manual_seed(1 + d.rank() / (d.size() / dp));
  auto data = at::randint(s.gpt.vocab_size, {s.batch / dp, s.gpt.block_size + 1}, at::kLong);
  auto x = data.narrow(1, 0, s.gpt.block_size).contiguous();
  auto y = data.narrow(1, 1, s.gpt.block_size).contiguous();
  auto step = [&] {
    opt.zero_grad();
    if (pipe) {
      const double loss = pipe->step(x, y);
      opt.step();
      return loss;
    }
    auto logits = ddp    ? ddp->forward([&] { return m.forward(x); })
                  : fsdp ? fsdp->forward(x)
                         : m.forward(x);
    auto loss = m.parallel_loss(logits, y);
    loss.backward();
    if (!partial.empty()) sum_deferred_partial_gradients(partial, d);
    if (fsdp) {
      fsdp->step(opt);
    } else {
      opt.step();
    }
    return loss.item<double>();
  };
  for (int i = 0; i < s.warmup; ++i) step();
  d.barrier("transformer warm-up");
  std::vector<double> times;
  double loss = 0;
  for (int i = 0; i < s.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    loss = step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  write_worker_csv(d, arg_or(kv, "--csv", "transformer.csv"), times, params, loss);
  d.barrier("transformer end");
  return 0;
}

namespace {

// One launch's figures, read from rank 0's CSV.
struct Launch {
  double tokens_per_s = 0, loss = 0;
  std::vector<double> rss_mib;  // per rank
};

Launch read_launch(const std::string& path, int64_t tokens_per_step) {
  std::ifstream in(path);
  if (!in) throw Error("transformer: no results in " + path + " (the run wrote none)");
  std::vector<double> steps;
  Launch l;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    for (size_t a = 0, b; a <= line.size(); a = b + 1) {
      b = std::min(line.find(',', a), line.size());
      f.push_back(line.substr(a, b - a));
    }
    if (f[0] == "step") steps.push_back(std::stod(f[1]));
    if (f[0] == "rss") l.rss_mib.push_back(std::stod(f[2]) / (1024.0 * 1024.0));
    if (f[0] == "loss") l.loss = std::stod(f[1]);
  }
  if (steps.empty()) throw Error("transformer: no timed steps in " + path);
  std::sort(steps.begin(), steps.end());
  const size_t n = steps.size();
  const double median = n % 2 ? steps[n / 2] : (steps[n / 2 - 1] + steps[n / 2]) / 2;
  l.tokens_per_s = static_cast<double>(tokens_per_step) / median;
  return l;
}

struct Config {
  std::string mode, label;
  int ranks;
  std::string key() const { return mode + "_" + std::to_string(ranks); }
};
const std::vector<Config> kConfigs = {{"ddp", "DDP, 2 ranks", 2},
                                      {"tp", "tensor parallel, tp 2", 2},
                                      {"tp-sp", "tensor + sequence parallel, tp 2", 2},
                                      {"tp", "tensor parallel, tp 4", 4},
                                      {"fsdp", "FSDP, 4 ranks (FSDP2 on the Python side)", 4},
                                      {"fsdp-tp", "FSDP x TP, dp 2 x tp 2", 4},
                                      {"pp-tp", "pipeline x TP, pp 2 x tp 2 (1F1B)", 4}};

std::string rss_cell(const std::vector<Launch>& launches) {
  std::string s;
  const size_t ranks = launches.empty() ? 0 : launches.back().rss_mib.size();
  for (size_t r = 0; r < ranks; ++r) {
    double peak = 0;
    for (const auto& l : launches) peak = std::max(peak, l.rss_mib[r]);
    s += (r ? " / " : "") + fixed(peak, 0);
  }
  return s;
}

// Keys "<side>/<mode>": side "cpp" or "py".
using Launches = std::map<std::string, std::vector<Launch>>;

std::string table(const Launches& runs) {
  auto mean = [&](const std::string& key) {
    double sum = 0;
    for (const auto& l : runs.at(key)) sum += l.tokens_per_s;
    return sum / static_cast<double>(runs.at(key).size());
  };
  std::string t =
      "| configuration | scaletrain tokens/s | Python tokens/s | scaletrain / Python | peak RSS "
      "MiB per rank, scaletrain | peak RSS MiB per rank, Python | last loss, scaletrain / "
      "Python |\n|---|---|---|---|---|---|---|\n";
  for (const auto& c : kConfigs) {
    const std::string cpp = "cpp/" + c.key(), py = "py/" + c.key();
    if (!runs.count(cpp)) continue;  // not in a --quick run
    t += "| " + c.label + " | " + fixed(mean(cpp), 0) + " | " + fixed(mean(py), 0) + " | " +
         fixed(mean(cpp) / mean(py), 2) + "x | " + rss_cell(runs.at(cpp)) + " | " +
         rss_cell(runs.at(py)) + " | " + fixed(runs.at(cpp).back().loss, 4) + " / " +
         fixed(runs.at(py).back().loss, 4) + " |\n";
  }
  return t;
}

RunSize suite_size(bool quick, const std::string& arch) {
  RunSize s;
  s.arch = arch;
  if (quick) {  // seconds: a check that every path runs, not a measurement
    s.gpt.n_layer = 2, s.gpt.n_head = 4, s.gpt.n_embd = 64, s.gpt.block_size = 32;
    s.gpt.vocab_size = 256, s.batch = 4, s.steps = 3, s.warmup = 1;
  } else {
    s.gpt.n_layer = 4, s.gpt.n_head = 8, s.gpt.n_embd = 256, s.gpt.block_size = 128;
    s.gpt.vocab_size = 512, s.batch = 4, s.steps = 20, s.warmup = 3;
  }
  s.gpt.tied_head = false;
  if (arch == "llama") {  // key/value heads half the heads (the degree 4 divides them); the MLP
                          // about 8/3 the width
    s.gpt.n_head = 8;
    s.kv_heads = 4;
    s.intermediate = quick ? 176 : 688;
  }
  return s;
}

std::string llama_note(const RunSize& s, int64_t params) {
  const GPTConfig& c = s.gpt;
  return "Both sides: a Llama of " + std::to_string(c.n_layer) + " layers, " +
         std::to_string(c.n_head) + " heads over " + std::to_string(s.kv_heads) +
         " key/value heads, " + std::to_string(c.n_embd) + " wide, SwiGLU " +
         std::to_string(s.intermediate) + " wide, context " + std::to_string(c.block_size) +
         ", vocabulary " + std::to_string(c.vocab_size) + ", untied head (" +
         std::to_string(params) + " parameters, checked equal on the Python side), global batch " +
         std::to_string(s.batch) + " sequences (" + std::to_string(s.batch * c.block_size) +
         " tokens per step), AdamW (lr 3e-4, weight decay 0.1), random tokens, " +
         std::to_string(s.warmup) + " warm-up and " + std::to_string(s.steps) +
         " timed steps per launch, processes and threads as in the GPT suite. scaletrain: the "
         "zoo's Llama (zoo/llama.h) under the same wrappers as the GPT's. Python "
         "(benchmarks/python/transformer_peer.py --arch llama): the same architecture with "
         "Hugging Face's names, parallelize_module with ColwiseParallel on q/k/v/gate/up and "
         "RowwiseParallel on o/down (each rank its heads and key/value heads), RowwiseParallel "
         "on the embedding and ColwiseParallel on the head with loss_parallel(), "
         "SequenceParallel on the RMSNorms for tp-sp; FSDP2 per decoder layer; "
         "torch.distributed.pipelining for pp-tp.";
}

void add_transformer_results(SuiteResult& r, const Launches& runs, const RunSize& s,
                             int64_t params) {
  for (size_t i = 0; i < kConfigs.size(); ++i) {
    if (!runs.count("cpp/" + kConfigs[i].key())) continue;  // not in a --quick run
    for (const std::string side : {"cpp", "py"}) {
      std::vector<double> v;
      for (const auto& l : runs.at(side + "/" + kConfigs[i].key())) v.push_back(l.tokens_per_s);
      r.samples.push_back({side == "cpp" ? "scaletrain (C++)" : "PyTorch (Python)",
                           kConfigs[i].label, static_cast<double>(i), v});
    }
  }
  r.notes.push_back(
      "**tokens/s (median step of each launch, mean over the rounds) and peak "
      "resident memory per rank (rank 0 / rank 1 / ..., the largest over the rounds)**"
      "\n\n" +
      table(runs));
  const GPTConfig& c = s.gpt;
  if (s.arch == "llama") {
    r.notes.push_back(llama_note(s, params));
    return;
  }
  r.notes.push_back(
      "Both sides: a GPT of " + std::to_string(c.n_layer) + " layers, " + std::to_string(c.n_head) +
      " heads, " + std::to_string(c.n_embd) + " wide, context " + std::to_string(c.block_size) +
      ", vocabulary " + std::to_string(c.vocab_size) + ", untied head (" + std::to_string(params) +
      " parameters, checked equal on the Python side), global batch " + std::to_string(s.batch) +
      " sequences (" + std::to_string(s.batch * c.block_size) +
      " tokens per step), AdamW (lr "
      "3e-4, weight decay 0.1), GPT-2's initialisation, random tokens (one fixed batch, so the "
      "last "
      "loss, after every step of a launch, shows both sides training the same function), " +
      std::to_string(s.warmup) + " warm-up and " + std::to_string(s.steps) +
      " timed steps per launch, 2 or 4 processes with one intra-op thread "
      "each (OMP_NUM_THREADS=1, set_num_threads(1); 4 processes share the cores where the "
      "machine has fewer), the Gloo process group, the same torch. "
      "scaletrain: DistributedDataParallel (same-machine gradients through shared memory, its "
      "default), GPT::parallelize with the vocabulary-parallel cross entropy, "
      "ShardedDataParallel stage 3 with a unit per block (over the mesh's dp group in 2D), "
      "for pp-tp the plan over the mesh's tp pairs and the chain in two DistPipeline stages "
      "under 1F1B over " +
      std::to_string(s.chunks) +
      " micro-batches. "
      "Python (benchmarks/python/transformer_peer.py): torch DDP; parallelize_module with "
      "ColwiseParallel / RowwiseParallel on the same plan (c_attn's rows interleaved once so "
      "that each rank holds its own heads of q, k and v), SequenceParallel on the LayerNorms for "
      "tp-sp, the loss under loss_parallel() (no rank gathers the logits on either side); FSDP2 "
      "(fully_shard per block and on the model; on the 2D mesh's dp dimension after the tp "
      "plan); for pp-tp the same tp plan on the mesh's \"tp\" and two PipelineStages over its "
      "\"pp\" (torch.distributed.pipelining) under Schedule1F1B, the loss under "
      "loss_parallel().");
}

}  // namespace

namespace {
SuiteResult run_architecture(const SuiteOptions& o, const std::string& arch) {
  const std::string suite = arch == "llama" ? "llama" : "transformer";
  const std::string title = std::string(arch == "llama" ? "Llama" : "GPT") +
                            " on 2 and 4 CPU processes: scaletrain vs PyTorch's Python path";
  SuiteResult r = new_result(
      suite, title, "tokens/s",
      {Plot::Kind::kBars, title, "", "tokens per second (median step)", false, false}, o);
  const PythonPeer peer = python_peer(o, "transformer_peer.py");
  const RunSize s = suite_size(o.quick, arch);
  const int64_t params = parameter_count(*bench_model(s).module);
  const int64_t tokens_per_step = s.batch * s.gpt.block_size;
  Launches runs;
  for (int round = 0; round < o.repeats; ++round) {
    for (const auto& c : kConfigs) {
      // --quick: each path once (tp 4 is tp 2's at 4 ranks, FSDP a part of FSDP x TP's).
      if (o.quick && (c.key() == "tp_4" || c.key() == "fsdp_4")) continue;
      auto launch = [&](const std::string& side, std::vector<std::string> command) {
        const std::string name = side + "_" + c.key() + "_" + std::to_string(round);
        const std::string csv = o.work_dir + "/" + suite + "_" + name + ".csv";
        std::filesystem::remove(csv);
        auto sizes = size_args(s);
        command.insert(command.end(), sizes.begin(), sizes.end());
        command.insert(command.end(), {"--mode", c.mode, "--csv", csv});
        run_local_ranks(o, c.ranks, command, suite + "_" + name);
        runs[side + "/" + c.key()].push_back(read_launch(csv, tokens_per_step));
      };
      auto python = [&] {
        launch("py", {peer.python, peer.script, "--expect-params", std::to_string(params)});
      };
      if (round % 2 == 1) python();
      launch("cpp", {o.self_exe, "bench-worker", "transformer"});
      if (round % 2 == 0) python();
    }
  }
  add_transformer_results(r, runs, s, params);
  return r;
}
}  // namespace

SuiteResult run_transformer(const SuiteOptions& o) { return run_architecture(o, "gpt"); }
SuiteResult run_llama(const SuiteOptions& o) { return run_architecture(o, "llama"); }

}  // namespace scaletrain::bench
