// What the front and the full tool share (Note [Front] in commands.h): the app's frame, and
// parsing with one exit status for each kind of outcome.

#include <cxxabi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <typeinfo>

#include "commands.h"
#include "scaletrain/error.h"

namespace scaletrain::cli {

namespace {

// The library's option names and their flags, longest name first (so that
// TrainerOptions::pipeline.stages_per_device is not read as TrainerOptions::pipeline.stages).
std::vector<std::pair<std::string, std::string>>& flag_table() {
  static std::vector<std::pair<std::string, std::string>> table;
  return table;
}

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ':';
}

// Whether `name` ends where it stands at `at` in `message`: not followed by more of a name (a
// letter, '_', or '.' and a letter: TrainerOptions::device is not TrainerOptions::devices, and
// a sentence's full stop ends it).
bool ends_there(const std::string& message, size_t at, const std::string& name) {
  const size_t next = at + name.size();
  if (next >= message.size()) return true;
  const char c = message[next];
  if (c == '.') {
    return next + 1 >= message.size() ||
           !std::islower(static_cast<unsigned char>(message[next + 1]));
  }
  return !is_name_char(c);
}

}  // namespace

void name_flags(const CLI::App& cmd,
                const std::vector<std::pair<std::string, std::string>>& fields) {
  auto& table = flag_table();
  for (const auto& [field, flag] : fields) {
    cmd.get_option(flag);  // throws where the flag is not one of cmd's: the table stays true
    table.emplace_back(field, flag);
  }
  std::stable_sort(table.begin(), table.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

std::string in_flag_names(const std::string& message) {
  const auto& table = flag_table();
  std::string out;
  for (size_t i = 0; i < message.size();) {
    const bool starts = i == 0 || !is_name_char(message[i - 1]);
    const auto hit = std::find_if(table.begin(), table.end(), [&](const auto& entry) {
      return starts && message.compare(i, entry.first.size(), entry.first) == 0 &&
             ends_there(message, i, entry.first);
    });
    if (hit == table.end()) {
      out += message[i++];
    } else {
      out += hit->second;
      i += hit->first.size();
    }
  }
  return out;
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
