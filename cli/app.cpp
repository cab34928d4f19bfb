// What the front and the full tool share (Note [Front] in commands.h): the app's frame, and
// parsing with one exit status for each kind of outcome.

#include <iostream>
#include <map>
#include <regex>

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
    std::cerr << "scaletrain: " << in_flag_names(e.what()) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "scaletrain: error: " << in_flag_names(e.what()) << "\n";
    return 1;
  }
}

}  // namespace scaletrain::cli
