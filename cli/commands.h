#pragma once
// Each subcommand of the `scaletrain` tool registers itself on the CLI11 app and leaves the
// action to run once parsing succeeded. Actions return the process exit status.

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace scaletrain::cli {

using Action = std::function<int()>;

void add_run_command(CLI::App& app, Action& action);
void add_check_command(CLI::App& app, Action& action);
void add_bench_command(CLI::App& app, Action& action);
void add_train_command(CLI::App& app, Action& action);

/// The tool's own command line (argv), for subcommands that start themselves again.
const std::vector<std::string>& program_args();

/// A --nproc-per-node value: a whole number (validated later against the machine), or "auto"
/// for `auto_value`. Throws UsageError naming the value otherwise.
int parse_nproc_per_node(const std::string& value, int auto_value);

}  // namespace scaletrain::cli
