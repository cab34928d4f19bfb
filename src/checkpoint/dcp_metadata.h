#pragma once
// The `.metadata` file of a PyTorch distributed checkpoint (internal; Note [DCP layout] in
// dcp_metadata.cpp): which keys the folder holds, each tensor's dtype, global shape and saved
// chunks, and where each chunk's bytes are. Encoded as the pickle Python's dcp.save writes, and
// decoded by the restricted reader (pickle.h). LibTorch-free: dtypes are PyTorch's names.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "scaletrain/box.h"

namespace scaletrain::dcp {

/// Where an item's bytes are: a file of the folder (a plain name, never a path) and a range.
struct StorageInfo {
  std::string relative_path;
  int64_t offset = 0, length = 0;
  bool operator==(const StorageInfo& o) const {
    return relative_path == o.relative_path && offset == o.offset && length == o.length;
  }
};

struct Chunk {
  Box box;
  StorageInfo storage;
};

struct TensorEntry {
  std::string dtype;           // "float32", "bfloat16", "int64"... (torch.<dtype>)
  std::vector<int64_t> shape;  // global
  std::vector<Chunk> chunks;
};

struct Metadata {
  std::map<std::string, TensorEntry> tensors;  // TensorStorageMetadata, by flattened key
  std::map<std::string, StorageInfo> values;   // BytesStorageMetadata: a torch.save'd object
  /// planner_data: the nested keys each flattened key came from, for dcp_to_torch_save; parts
  /// made only of digits are written as ints (list indices). Not read back.
  std::map<std::string, std::vector<std::string>> paths;
  std::string version;  // "1.0.0" as 2.11 writes
};

/// The dtypes a DCP tensor may have here (torch.<name>).
const std::vector<std::string>& known_dtypes();

/// The pickle of `m` as Python's FileSystemWriter.finish() writes it; `save_id` goes to
/// storage_meta.save_id.
std::string encode_metadata(const Metadata& m, const std::string& save_id);

/// Reads `bytes` (the file `source`) with the restricted reader. Throws Error naming `source`
/// and what it found for a damaged or foreign pickle, a class not in the allow-list, a chunk
/// without storage, a storage path that is not a plain file name, a dtype not in
/// known_dtypes(), or transformed (compressed) items.
Metadata decode_metadata(std::string_view bytes, const std::string& source);

}  // namespace scaletrain::dcp
