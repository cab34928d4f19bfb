#pragma once
// The tests' side of PyTorch in Python (the project's .venv): running a helper script of
// tests/scripts/, and reading the dicts of tensors it writes with torch.save.

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "support/subprocess.h"

namespace scaletrain::testing {

/// The .venv's Python on tests/scripts/`script` with `args`; its output (stdout and stderr). A
/// failing exit status fails the test, with the output.
inline std::string run_python(const std::string& script, const std::string& args,
                              int timeout_s = 300) {
  auto r = run_command(
      std::string(VENV_DIR) + "/bin/python " + script_path(script) + " " + args + " 2>&1",
      timeout_s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

/// The folder that tests/scripts/`script` writes with `make DIR`: made once per build and per
/// version of the script (the build's folder test-references/, named by the script's hash), and
/// shared by every test process that asks for it. It is written beside its place and renamed in,
/// so processes that ask at once each get a whole one.
inline std::filesystem::path made_by(const std::string& script) {
  namespace fs = std::filesystem;
  std::ifstream f(script_path(script), std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  const fs::path dir = fs::path(cli_path()).parent_path() / "test-references" /
                       (script + "-" + std::to_string(std::hash<std::string>{}(text)));
  if (fs::exists(dir)) return dir;
  const fs::path tmp = dir.string() + ".tmp" + std::to_string(::getpid());
  fs::create_directories(tmp);
  run_python(script, "make " + tmp.string());
  std::error_code ec;
  fs::rename(tmp, dir, ec);  // another process's may have come first: take it
  if (ec) fs::remove_all(tmp);
  return dir;
}

/// A dict of tensors saved by torch.save (a plain dict: LibTorch's unpickler rebuilds no
/// OrderedDict).
inline std::map<std::string, at::Tensor> read_tensor_dict(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : torch::pickle_load(bytes).toGenericDict()) {
    out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return out;
}

}  // namespace scaletrain::testing
