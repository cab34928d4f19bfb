#pragma once
// The tests' side of PyTorch in Python (the project's .venv): running a helper script of
// tests/scripts/, and reading the dicts of tensors it writes with torch.save.

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>
#include <map>
#include <string>
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
