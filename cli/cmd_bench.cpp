// `scaletrain bench SUITE`: reruns an experiment of the seeds and writes its raw repetitions
// (CSV), statistics (JSON), a plot (PNG) and a Markdown report section.

#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "commands.h"
#include "scaletrain/bench_suites.h"
#include "scaletrain/error.h"
#include "scaletrain/version.h"

namespace scaletrain::cli {
namespace {

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "scaletrain" : p.string();
}

std::string suite_list() {
  std::string s;
  for (auto& suite : bench::suites()) s += "  " + suite.name + ": " + suite.description + "\n";
  return s;
}

struct BenchArgs {
  std::string suite;
  bool quick = false, full = false;
  std::string out = "bench-out";
  int repeats = 5;
};

// `bench SUITE`: the chosen suites, each written into the report.
int run_suites(const BenchArgs& args) {
  if (args.suite == "list") {
    std::cout << suite_list();
    return 0;
  }
  std::vector<const bench::Suite*> chosen;
  for (auto& s : bench::suites()) {
    if (args.suite == "all" || s.name == args.suite) chosen.push_back(&s);
  }
  if (chosen.empty()) {
    throw UsageError("unknown benchmark suite '" + args.suite + "'; the suites are:\n" +
                     suite_list() + "or 'all'");
  }
  if (args.repeats < 1) throw UsageError("--repeats must be at least 1");
  bench::SuiteOptions o;
  o.quick = args.quick || (!args.full && cuda_device_count() == 0);
  o.repeats = args.repeats;
  o.self_exe = self_exe();
  o.work_dir = args.out + "/work";
  std::filesystem::create_directories(o.work_dir);
  auto machine = bench::describe_machine(
      cuda_device_count() > 0 ? std::to_string(cuda_device_count()) + "x " + cuda_device_name(0)
                              : "none",
      libtorch_version());
  for (auto* s : chosen) {
    std::cout << "bench " << s->name << (o.quick ? " (quick)" : "") << " ..." << std::endl;
    auto result = s->run(o);
    std::cout << bench::write_suite(result, machine, args.out);
  }
  std::filesystem::remove_all(o.work_dir);
  std::cout << "report: " << args.out << "/report.md" << std::endl;
  return 0;
}

// The all-reduce suite's worker: its flags among the extra arguments.
int run_allreduce_worker(const std::vector<std::string>& extras) {
  std::string csv, only;
  int repeats = 5;
  bool quick = false;
  int64_t bytes = 0;
  for (size_t i = 0; i < extras.size(); ++i) {
    if (extras[i] == "--csv" && i + 1 < extras.size()) csv = extras[i + 1];
    if (extras[i] == "--repeats" && i + 1 < extras.size()) repeats = std::stoi(extras[i + 1]);
    if (extras[i] == "--quick") quick = true;
  }
  for (size_t i = 0; i + 1 < extras.size(); ++i) {
    if (extras[i] == "--only") only = extras[i + 1];
    if (extras[i] == "--bytes") bytes = std::stoll(extras[i + 1]);
  }
  return bench::run_allreduce_worker(csv, quick, repeats, only, bytes);
}

// `bench-worker SUITE ...` (hidden): one process of a multi-process suite.
void add_bench_worker_command(CLI::App& app, Action& action) {
  auto* worker = app.add_subcommand("bench-worker", kBenchWorkerDescription);
  worker->group("");
  auto suite = std::make_shared<std::string>();
  worker->add_option("suite", *suite)->required();
  worker->allow_extras();
  worker->callback([suite, &action, worker] {
    auto extras = worker->remaining();
    action = [suite, extras] {
      if (*suite == "ddp") return bench::run_ddp_worker(extras);
      if (*suite == "zero") return bench::run_zero_worker(extras);
      if (*suite == "transformer") return bench::run_transformer_worker(extras);
      if (*suite == "experts") return bench::run_experts_worker(extras);
      if (*suite == "pipeline-ranks") return bench::run_pipeline_ranks_worker(extras);
      if (*suite == "allreduce") return run_allreduce_worker(extras);
      throw UsageError("no worker for suite '" + *suite + "'");
    };
  });
}

}  // namespace

void add_bench_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("bench", kBenchDescription);
  auto args = std::make_shared<BenchArgs>();
  cmd->add_option("suite", args->suite, "A suite name, 'all', or 'list'")->required();
  cmd->add_flag("--quick", args->quick, "Small sizes (the default without a GPU)");
  cmd->add_flag("--full", args->full, "Full sizes even without a GPU");
  cmd->add_option("--out", args->out, "Output folder")->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "Timed repetitions per configuration")
      ->capture_default_str();
  cmd->callback([args, &action] { action = [args] { return run_suites(*args); }; });
  add_bench_worker_command(app, action);
}

}  // namespace scaletrain::cli
