#pragma once
// Token data sets for language models, in the format nanoGPT's prepare.py and llm.c write
// (docs/text.md):
//
//   train.bin, val.bin   token ids as little-endian uint16, one after another, nothing else
//                        (nanoGPT); or llm.c's shard: a header of 256 int32 (magic 20240520,
//                        version 1, the token count) and then the same ids; or llm.c's shard
//                        of uint32 ids for vocabularies past 65536 (Llama 3's 128,256): magic
//                        20240801, version 7
//
//   scaletrain::write_byte_tokens("shakespeare.txt", "data/shakespeare");   // bytes as tokens
//   scaletrain::TokenWindowOptions w;
//   w.block_size = 64;                                                       // T, the context
//   task.train_data = scaletrain::token_windows("data/shakespeare/train.bin", w);
//   w.mode = scaletrain::TokenWindowOptions::Mode::kStrided;
//   task.test_data = scaletrain::token_windows("data/shakespeare/val.bin", w);
//
// A sample is a window of the file and the same window one token on: inputs x = tokens[s, s+T)
// and targets y = tokens[s+1, s+T+1), both int64 [T] (a batch: Batch::inputs x [B, T] and
// Batch::targets y [B, T], as a GPT's forward and the trainer's per-token cross entropy take
// them). What sample i holds depends on (file, options, i) alone — not on the rank, the world
// size, the batch or the loader thread — so a run resumes exactly and any world size trains on
// the same samples.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "scaletrain/data_source.h"

namespace scaletrain {

/// A token file, memory-mapped read-only: the ids are read from the page cache when asked for,
/// so a file larger than memory works. Safe to read from many threads at once (loader workers);
/// the file must not be changed while it is mapped (write_byte_tokens() replaces files by
/// rename, which leaves a mapping of the old one intact).
class TokenFile {
 public:
  /// Maps `path`. Throws UsageError naming the path when it is missing or not a regular file,
  /// is empty, holds an odd number of bytes (not uint16 ids), or is an llm.c file of another
  /// version or whose header's count disagrees with its size (in its ids' width).
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  /// Number of tokens (an llm.c header is not counted).
  int64_t size() const { return size_; }
  /// Token i; throws Error naming the file for i outside [0, size()).
  uint32_t at(int64_t i) const;
  /// Tokens [start, start + len) as an int64 tensor [len] of its own (a copy); throws Error
  /// naming the file for a range outside it.
  at::Tensor window(int64_t start, int64_t len) const;
  /// The ids themselves, size() of them, each id_bytes() wide (2: uint16, 4: uint32).
  const void* ids() const { return tokens_; }
  int id_bytes() const { return id_bytes_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  int64_t size_ = 0;
  int id_bytes_ = 2;
};

struct TokenWindowOptions {
  enum class Mode {
    kRandom,   // sample i starts at a position drawn from (seed, i): nanoGPT's get_batch, but
               // repeatable, and the same for every rank and world size
    kStrided,  // sample i starts at i * block_size: windows side by side, each token a target
               // once (an evaluation over the whole file)
  };
  Mode mode = Mode::kRandom;
  int64_t block_size = 64;  // T, tokens per window (nanoGPT's block_size, the model's context)
  /// Samples in the data source. kRandom: 0 gives (size - 1) / block_size, as many windows as
  /// the file holds side by side. kStrided: 0 gives all of them, (size - 1) / block_size; fewer
  /// takes the first that many.
  int64_t samples = 0;
  uint64_t seed = 0;  // kRandom: which windows (a different seed, other windows)
  /// The model's vocabulary: every id of a window read must lie below it, else the batch throws
  /// UsageError naming the file, the id and its position (an embedding's own error names
  /// neither). 0: any id. Each window is checked as it is copied: no pass over the file.
  int64_t vocab_size = 0;
};

/// The windows of the token file `path` as the trainer's data source (data_source.h): sample i is
/// (x = tokens[s, s+T), y = tokens[s+1, s+T+1)) with s as options.mode says. The file stays
/// mapped while the source (or a copy of its batch function) lives. Throws UsageError naming
/// the path for a file TokenFile refuses or one shorter than block_size + 1 tokens, and naming
/// the value for block_size < 1, samples < 0, vocab_size < 0, or more strided samples than the
/// file holds. Its batches throw UsageError for an id at or past options.vocab_size.
DataSource token_windows(const std::string& path, const TokenWindowOptions& options = {});

/// What write_byte_tokens() wrote.
struct ByteTokensReport {
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t files = 0;  // text files read
};

/// Tokenizes text a byte at a time (token = byte value, vocabulary 256: UTF-8 text as its bytes)
/// into `out_dir`/train.bin and `out_dir`/val.bin, created or replaced atomically (a temporary
/// file renamed: a reader sees the old file or the new one). `input` is a file, or a folder
/// whose regular files (in every sub-folder; none under `out_dir`) are read in the order of
/// their paths' bytes and joined without separators. The first floor(n * (1 - val_fraction))
/// bytes go to train.bin, the rest to val.bin, as nanoGPT's prepare.py splits. The text is read
/// into memory. Throws UsageError naming the value and the fix for a missing input, a folder
/// without bytes, val_fraction outside (0, 1), or a split that leaves either file empty.
ByteTokensReport write_byte_tokens(const std::string& input, const std::string& out_dir,
                                   double val_fraction = 0.1);

/// The text of byte tokens (any shape, integer ids in [0, 256), read in order). Throws
/// UsageError naming the first id outside it (not byte tokens: a BPE vocabulary's).
std::string decode_bytes(const at::Tensor& tokens);

}  // namespace scaletrain
