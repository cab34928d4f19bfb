// What the front and the full tool share (Note [Front] in commands.h): the app's frame, and
// parsing with one exit status for each kind of outcome.

#include <cxxabi.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <regex>
#include <typeinfo>

#include "commands.h"
#include "scaletrain/error.h"

namespace scaletrain::cli {

// The library's errors name its options (TrainerOptions::batch_size); the command line's user
// set them as flags (--batch-size); a strategy's own options are one level down
// (TrainerOptions::pipeline.chunks is --chunks). Names without a flag stay as they are.
std::string in_flag_names(const std::string& message) {
  static const std::map<std::string, std::string> flags = {
      {"TrainerOptions::accumulate", "--accumulate"},
      {"TrainerOptions::amp", "--amp"},
      {"TrainerOptions::async_checkpoint", "--async-checkpoint"},
      {"TrainerOptions::pipeline.balance", "--balance"},
      {"TrainerOptions::batch_size", "--batch-size"},
      {"TrainerOptions::checkpoint_every", "--checkpoint-every"},
      {"TrainerOptions::checkpoint_format", "--checkpoint-format"},
      {"TrainerOptions::pipeline.checkpoint", "--checkpoint-activations"},
      {"TrainerOptions::pipeline.chunks", "--chunks"},
      {"TrainerOptions::data_on_device", "--data-on-device"},
      {"TrainerOptions::device", "--device"},
      {"TrainerOptions::devices", "--devices"},
      {"TrainerOptions::epochs", "--epochs"},
      {"TrainerOptions::eval_batch_size", "--eval-batch-size"},
      {"TrainerOptions::fault_tolerant", "--fault-tolerant"},
      {"TrainerOptions::keep", "--keep"},
      {"TrainerOptions::log_every", "--log-every"},
      {"TrainerOptions::max_grad_norm", "--max-grad-norm"},
      {"TrainerOptions::out_dir", "--out"},
      {"TrainerOptions::overwrite", "--overwrite"},
      {"TrainerOptions::peak_flops", "--peak-flops"},
      {"TrainerOptions::pipeline.stages", "--pipeline-stages"},
      {"TrainerOptions::resume", "--resume"},
      {"TrainerOptions::pipeline.schedule", "--schedule"},
      {"TrainerOptions::tensor_parallel.sequence_parallel", "--sequence-parallel"},
      {"TrainerOptions::pipeline.split_size", "--split-size"},
      {"TrainerOptions::pipeline.stages_per_device", "--stages-per-device"},
      {"TrainerOptions::strategy", "--strategy"},
      {"TrainerOptions::tensor_parallel.size", "--tp"},
      {"TrainerOptions::timeout_s", "--timeout"},
      {"TrainerOptions::ddp.uneven_inputs", "--uneven-inputs"},
      {"TrainerOptions::workers", "--workers"},
      {"ReplicaGroupOptions::lighthouse", "--lighthouse"},
      {"ReplicaGroupOptions::replica_id", "--replica-id"},
      {"TokenWindowOptions::vocab_size", "--vocab-size"},
  };
  static const std::regex name(
      R"((TrainerOptions|ReplicaGroupOptions|TokenWindowOptions)::[a-z_]+(\.[a-z_]+)?)");
  std::string out;
  auto from = message.cbegin();
  for (std::sregex_iterator it(message.begin(), message.end(), name), end; it != end; ++it) {
    out.append(from, (*it)[0].first);
    auto flag = flags.find(it->str());
    out += flag == flags.end() ? it->str() : flag->second;
    from = (*it)[0].second;
  }
  return out.append(from, message.cend());
}

namespace {
std::vector<std::string> g_args;

// Names the unknown subcommand or flag instead of CLI11's generic "a subcommand is required".
bool check_first_argument(CLI::App& app, int argc, char** argv) {
  if (argc <= 1) return true;
  const std::string first = argv[1];
  bool known = first == "-h" || first == "--help" || first == "--version";
  for (const auto* sub : app.get_subcommands({})) known = known || sub->check_name(first);
  if (known) return true;
  std::string names;
  for (const auto* sub : app.get_subcommands({})) {
    if (sub->get_description().empty()) continue;  // internal
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  std::cerr << "scaletrain: unknown " << (first[0] == '-' ? "option '" : "subcommand '") << first
            << "'; subcommands are: " << names << "\nRun 'scaletrain --help' for usage.\n";
  return false;
}

// An exception without a message is named by its type, so that its line says which part failed.
std::string described(const std::exception& e) {
  const std::string what = e.what();
  if (what.find_first_not_of(" \t\r\n") != std::string::npos) return what;
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(
      abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status), std::free);
  return std::string(status == 0 && name ? name.get() : typeid(e).name()) +
         " without a message (a peer, or the store it served, may be gone: see the other ranks' "
         "errors)";
}

std::atomic<int> g_held_signal{0};
void hold_signal(int sig) { g_held_signal = sig; }

// Regression (EmptyErrorLineWhenTheRendezvousHostDied): a rank whose peer vanished failed and
// was stopped by its launcher (SIGTERM) at the same moment; it had written "scaletrain: error: "
// and died before the message, which went out in a second write. The line goes out whole, in one
// write (a pipe takes up to PIPE_BUF bytes at once or waits), and a SIGTERM or SIGINT that comes
// meanwhile, on any thread, is held until it is out and then takes effect as it would have.
void say_whole_line(const std::string& text) {
  const std::string line = text + "\n";
  struct sigaction hold {};
  hold.sa_handler = hold_signal;
  sigemptyset(&hold.sa_mask);
  hold.sa_flags = SA_RESTART;
  struct sigaction old_term = hold, old_int = hold;
  sigaction(SIGTERM, &hold, &old_term);
  sigaction(SIGINT, &hold, &old_int);
  std::cerr.flush();
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGINT, &old_int, nullptr);
  if (const int sig = g_held_signal.exchange(0)) ::raise(sig);
}

}  // namespace

const std::vector<std::string>& program_args() { return g_args; }

void configure_app(CLI::App& app) {
  app.description(
      "scaletrain: take a LibTorch training job from one device to many devices, "
      "processes and machines.");
  app.name("scaletrain");
  app.require_subcommand(1);
  // A repeated option takes its last value, as Python's argparse (and so torchrun) does.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer("Run 'scaletrain SUBCOMMAND --help' for a subcommand's options.");
}

int parse_and_run(CLI::App& app, const Action& action, int argc, char** argv) {
  g_args.assign(argv, argv + argc);
  if (!check_first_argument(app, argc, argv)) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "scaletrain: " << e.what() << "\nRun 'scaletrain --help' for usage.\n";
    return 2;
  }
  try {
    return action ? action() : 0;
  } catch (const UsageError& e) {
    say_whole_line("scaletrain: " + in_flag_names(e.what()));
    return 2;
  } catch (const std::exception& e) {
    say_whole_line("scaletrain: error: " + in_flag_names(described(e)));
    return 1;
  }
}

}  // namespace scaletrain::cli
