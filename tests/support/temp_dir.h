#pragma once
// A fresh folder under the system's temporary one, named by the test and the process, removed
// with everything in it at the end of the scope.

#include <unistd.h>

#include <filesystem>
#include <string>

namespace scaletrain::testing {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("scaletrain_" + name + "_" + std::to_string(getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace scaletrain::testing
