// Regression test for Note [libstdc++ first] (cmake/Dependencies.cmake): std::filesystem calls
// from a LibTorch-linked executable bound to libtorch.so's own copy, and remove_all crashed.

#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;

TEST(FilesystemInterposition, RemoveAllWorksInTorchLinkedBinaries) {
  fs::path root = fs::temp_directory_path() / ("scaletrain_fs_" + std::to_string(getpid()));
  fs::create_directories(root / "a" / "b");
  std::ofstream(root / "a" / "b" / "f.txt") << "x";
  EXPECT_EQ(fs::remove_all(root), 4u);
  EXPECT_FALSE(fs::exists(root));
}

}  // namespace
