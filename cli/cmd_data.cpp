// `scaletrain data`: prepares data sets for training. `data text` writes the token files of a
// text (tokens.h, docs/text.md) that `scaletrain train --dataset text` reads.

#include <iostream>

#include "commands.h"
#include "scaletrain/tokens.h"

namespace scaletrain::cli {

void add_data_command(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("data", kDataDescription);
  cmd->require_subcommand(1);
  auto* text = cmd->add_subcommand(
      "text",
      "Tokenize a text file, or a folder of them, a byte at a time (vocabulary 256) into "
      "OUT/train.bin and OUT/val.bin, nanoGPT's uint16 token files");
  struct Args {
    std::string input, out;
    double val_fraction = 0.1;
  };
  auto args = std::make_shared<Args>();
  text->add_option("--input", args->input,
                   "A text file, or a folder whose files are read in the order of their paths")
      ->required();
  text->add_option("--out", args->out, "Folder for train.bin and val.bin (made if missing)")
      ->required();
  text->add_option("--val-fraction", args->val_fraction,
                   "Share of the text, at its end, that goes to val.bin")
      ->capture_default_str();
  text->callback([args, &action] {
    action = [args] {
      const ByteTokensReport r = write_byte_tokens(args->input, args->out, args->val_fraction);
      std::cout << "wrote " << r.train_path << " (" << r.train_tokens << " tokens) and "
                << r.val_path << " (" << r.val_tokens << " tokens) from " << r.files
                << (r.files == 1 ? " file" : " files")
                << "; vocabulary 256 (bytes). Train on them with: scaletrain train --model "
                   "gpt-tiny --dataset text --data-dir "
                << args->out << "\n";
      return 0;
    };
  });
}

}  // namespace scaletrain::cli
