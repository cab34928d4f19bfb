// Token files (tokens.h, docs/text.md): the mapping, the windows the trainer reads, and the
// byte-level tokenizer that writes them.

#include "scaletrain/tokens.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

#include "runtime/atomic_file.h"
#include "scaletrain/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token files hold little-endian ids, read here in place");

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// llm.c's shard header: 256 int32, [0] the magic, [1] the version, [2] the count. GPT-2's
// shards (magic 20240520, version 1) hold uint16 ids, Llama 3's (20240801, version 7) uint32.
constexpr int64_t kHeaderBytes = 256 * 4;
constexpr int32_t kMagic16 = 20240520, kMagic32 = 20240801;

struct Layout {
  int64_t header = 0;  // bytes before the ids
  int id_bytes = 2;
};

// Where the ids of a file of `bytes` bytes mapped at `p` start, and their width: past an llm.c
// header, if it has one. nanoGPT's files have none; one whose first two ids read as a magic
// would start with id 55240 or 58753, outside GPT-2's 50257 and the bytes' 256.
Layout layout_of(const std::string& path, const unsigned char* p, int64_t bytes) {
  int32_t head[3] = {0, 0, 0};
  if (bytes < kHeaderBytes) return {};
  std::memcpy(head, p, sizeof head);
  if (head[0] != kMagic16 && head[0] != kMagic32) return {};
  const bool wide = head[0] == kMagic32;
  if (head[1] != (wide ? 7 : 1)) {
    throw UsageError("token file '" + path + "' is llm.c's " + (wide ? "uint32" : "uint16") +
                     " shard of version " + std::to_string(head[1]) + "; read are magic " +
                     std::to_string(kMagic16) + " version 1 (uint16 ids) and magic " +
                     std::to_string(kMagic32) +
                     " version 7 (uint32 ids): write it again with llm.c's write_datafile");
  }
  const int width = wide ? 4 : 2;
  if (width * int64_t{head[2]} != bytes - kHeaderBytes) {
    throw UsageError("token file '" + path + "' has llm.c's header, which counts " +
                     std::to_string(head[2]) + " tokens of " + std::to_string(width) +
                     " bytes, and " + std::to_string(bytes - kHeaderBytes) +
                     " bytes after it: the file is truncated or not a token file; write it again");
  }
  return {kHeaderBytes, width};
}

// splitmix64: output i of the stream seeded with `seed`, unrelated to its neighbours.
uint64_t splitmix(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Whether `p` lies under the folder `dir` (both as the file system resolves them).
bool lies_under(const fs::path& p, const fs::path& dir) {
  const fs::path a = fs::weakly_canonical(p);
  fs::path d = fs::weakly_canonical(dir);
  if (d.filename().empty()) d = d.parent_path();  // "out/" names the folder "out"
  return std::mismatch(d.begin(), d.end(), a.begin(), a.end()).first == d.end();
}

// The text files of `input`: itself, or a folder's regular files sorted by path (none under
// `out_dir`, where the token files go).
std::vector<fs::path> text_files(const fs::path& input, const fs::path& out_dir) {
  std::error_code ec;
  const auto status = fs::status(input, ec);
  if (fs::is_regular_file(status)) return {input};
  if (!fs::is_directory(status)) {
    throw UsageError(
        "text input '" + input.string() +
        "': " + (fs::exists(status) ? "neither a file nor a folder" : "no such file or folder") +
        "; give a text file or a folder of them");
  }
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(input, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file() && !lies_under(it->path(), out_dir)) files.push_back(it->path());
  }
  if (ec) {
    throw UsageError("cannot read the folder '" + input.string() + "': " + ec.message());
  }
  std::sort(files.begin(), files.end(),
            [](const fs::path& a, const fs::path& b) { return a.string() < b.string(); });
  return files;
}

std::string read_text(const std::vector<fs::path>& files) {
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (in) text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (!in.is_open() || in.bad()) {
      throw Error("cannot read the text file '" + f.string() + "': check its permissions");
    }
  }
  return text;
}

// Bytes [begin, end) of `text` as little-endian uint16 ids.
std::string byte_ids(const std::string& text, size_t begin, size_t end) {
  std::string out(2 * (end - begin), '\0');
  for (size_t k = begin; k < end; ++k) out[2 * (k - begin)] = text[k];
  return out;
}

// Regression (TokenPastTheVocabularyInTheMiddleOfAFileGaveABacktrace): an id at or past the model's
// vocabulary met the embedding as "index out of range in self" with a backtrace at tp 1 (tp 2's
// vocabulary-parallel loss named the token, but not the file). Tokens [start, start + len) of
// `f` are checked as a window is read: one max over ids the copy reads anyway.
template <typename Id>
void check_vocabulary(const TokenFile& f, const Id* ids, int64_t start, int64_t len,
                      int64_t vocab) {
  if (vocab <= 0) return;  // unchecked
  const Id* t = ids + start;
  Id top = 0;
  for (int64_t k = 0; k < len; ++k) top = std::max(top, t[k]);
  if (static_cast<int64_t>(top) < vocab) return;
  const int64_t at =
      std::find_if(t, t + len, [&](Id id) { return static_cast<int64_t>(id) >= vocab; }) - t;
  throw UsageError("token file '" + f.path() + "' holds id " + std::to_string(t[at]) +
                   " at token " + std::to_string(start + at) +
                   " (counted from 0), outside the model's vocabulary of " + std::to_string(vocab) +
                   " ids: give a vocabulary of at least " + std::to_string(int64_t{t[at]} + 1) +
                   " (TokenWindowOptions::vocab_size), or write the file again with the "
                   "model's tokenizer");
}

// Window s's inputs and targets (T tokens from `start`, and from start + 1) into x and y.
template <typename Id>
void copy_window(const TokenFile& f, const Id* ids, int64_t start, int64_t T, int64_t vocab,
                 int64_t* x, int64_t* y) {
  check_vocabulary(f, ids, start, T + 1, vocab);
  std::copy(ids + start, ids + start + T, x);
  std::copy(ids + start + 1, ids + start + T + 1, y);
}

}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw UsageError("token file '" + path + "': " + std::strerror(errno) +
                     "; write one with `scaletrain data text --input TEXT --out DIR` (or "
                     "nanoGPT's prepare.py) and give DIR/train.bin or DIR/val.bin");
  }
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  const auto bytes = static_cast<int64_t>(st.st_size);
  const std::string ids = "a token file holds uint16 ids, 2 bytes each; write it again";
  const std::string problem =
      !regular         ? "is not a regular file: give the file itself, e.g. DIR/train.bin"
      : bytes == 0     ? "is empty: " + ids
      : bytes % 2 != 0 ? "has " + std::to_string(bytes) + " bytes, an odd count: " + ids
                       : "";
  if (!problem.empty()) {
    ::close(fd);
    throw UsageError("token file '" + path + "' " + problem);
  }
  map_ = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw Error("cannot map token file '" + path + "': " + std::strerror(err));
  }
  map_bytes_ = static_cast<size_t>(bytes);
  const auto* base = static_cast<const unsigned char*>(map_);
  Layout layout;
  try {
    layout = layout_of(path, base, bytes);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    throw;
  }
  tokens_ = base + layout.header;
  id_bytes_ = layout.id_bytes;
  size_ = (bytes - layout.header) / id_bytes_;
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

uint32_t TokenFile::at(int64_t i) const {
  if (i < 0 || i >= size_) {
    throw Error("token " + std::to_string(i) + " of '" + path_ + "', which holds " +
                std::to_string(size_));
  }
  return id_bytes_ == 4 ? static_cast<const uint32_t*>(tokens_)[i]
                        : static_cast<const uint16_t*>(tokens_)[i];
}

at::Tensor TokenFile::window(int64_t start, int64_t len) const {
  if (start < 0 || len < 0 || start > size_ - len) {
    throw Error("tokens [" + std::to_string(start) + ", " + std::to_string(start + len) + ") of '" +
                path_ + "', which holds " + std::to_string(size_));
  }
  auto out = at::empty({len}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  if (id_bytes_ == 4) {
    const auto* t = static_cast<const uint32_t*>(tokens_);
    std::copy(t + start, t + start + len, o);
  } else {
    const auto* t = static_cast<const uint16_t*>(tokens_);
    std::copy(t + start, t + start + len, o);
  }
  return out;
}

DataSource token_windows(const std::string& path, const TokenWindowOptions& o) {
  if (o.block_size < 1) {
    throw UsageError("block_size " + std::to_string(o.block_size) +
                     ": a window holds at least 1 token (the model's context, e.g. 64)");
  }
  if (o.samples < 0) {
    throw UsageError("samples " + std::to_string(o.samples) + ": give 0 (one pass) or more");
  }
  if (o.vocab_size < 0) {
    throw UsageError("vocab_size " + std::to_string(o.vocab_size) +
                     ": give the model's vocabulary, or 0 to take any id");
  }
  auto file = std::make_shared<const TokenFile>(path);
  const int64_t n = file->size(), T = o.block_size;
  if (n < T + 1) {
    throw UsageError("token file '" + path + "' holds " + std::to_string(n) +
                     " tokens, fewer than a window of block_size " + std::to_string(T) +
                     " and its next token (" + std::to_string(T + 1) +
                     "): give more text or a smaller block size");
  }
  const int64_t side_by_side = (n - 1) / T;
  const bool strided = o.mode == TokenWindowOptions::Mode::kStrided;
  if (strided && o.samples > side_by_side) {
    throw UsageError("samples " + std::to_string(o.samples) + ": token file '" + path + "' holds " +
                     std::to_string(side_by_side) + " strided windows of " + std::to_string(T) +
                     " tokens; give at most that many, or 0 for all");
  }
  DataSource s;
  s.size = o.samples > 0 ? o.samples : side_by_side;
  const int64_t size = s.size;
  const uint64_t seed = o.seed;
  const int64_t vocab = o.vocab_size;
  s.batch = [file, T, n, size, strided, seed, vocab](const std::vector<int64_t>& indices,
                                                     uint64_t) {
    const auto B = static_cast<int64_t>(indices.size());
    auto x = at::empty({B, T}, at::kLong), y = at::empty({B, T}, at::kLong);
    int64_t* xp = x.data_ptr<int64_t>();
    int64_t* yp = y.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = indices[static_cast<size_t>(b)];
      if (i < 0 || i >= size) {
        throw Error("sample " + std::to_string(i) + " of the windows of '" + file->path() +
                    "', which has " + std::to_string(size));
      }
      // Starts in [0, n - T - 1]: the window and its next token fit.
      const int64_t start = strided
                                ? i * T
                                : static_cast<int64_t>(splitmix(seed, static_cast<uint64_t>(i)) %
                                                       static_cast<uint64_t>(n - T));
      if (file->id_bytes() == 4) {
        copy_window(*file, static_cast<const uint32_t*>(file->ids()), start, T, vocab, xp + b * T,
                    yp + b * T);
      } else {
        copy_window(*file, static_cast<const uint16_t*>(file->ids()), start, T, vocab, xp + b * T,
                    yp + b * T);
      }
    }
    return Batch{x, y, 0};
  };
  return s;
}

ByteTokensReport write_byte_tokens(const std::string& input, const std::string& out_dir,
                                   double val_fraction) {
  if (!(val_fraction > 0 && val_fraction < 1)) {
    throw UsageError("val_fraction " + c10::str(val_fraction) +
                     ": the share of the text kept for validation is in (0, 1), e.g. 0.1");
  }
  const auto files = text_files(input, out_dir);
  const std::string text = read_text(files);
  const auto n = static_cast<int64_t>(text.size());
  const auto n_train =
      static_cast<int64_t>(std::floor(static_cast<double>(n) * (1 - val_fraction)));
  if (n_train == 0 || n_train == n) {
    throw UsageError("text input '" + input + "' holds " + std::to_string(n) + " bytes in " +
                     std::to_string(files.size()) + " file(s), which val_fraction " +
                     c10::str(val_fraction) + " splits into " + std::to_string(n_train) +
                     " for train.bin and " + std::to_string(n - n_train) +
                     " for val.bin: give more text, or a fraction that leaves each file a token");
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec || !fs::is_directory(out_dir)) {
    throw UsageError("cannot make the output folder '" + out_dir + "'" +
                     (ec ? ": " + ec.message() : ": a file has its name") +
                     "; give a folder that can be written");
  }
  ByteTokensReport r;
  r.train_path = (fs::path(out_dir) / "train.bin").string();
  r.val_path = (fs::path(out_dir) / "val.bin").string();
  r.train_tokens = n_train;
  r.val_tokens = n - n_train;
  r.files = static_cast<int64_t>(files.size());
  const auto cut = static_cast<size_t>(n_train);
  write_atomically(r.train_path, byte_ids(text, 0, cut), "token file");
  write_atomically(r.val_path, byte_ids(text, cut, text.size()), "token file");
  return r;
}

std::string decode_bytes(const at::Tensor& tokens) {
  if (at::isFloatingType(tokens.scalar_type()) || tokens.scalar_type() == at::kBool) {
    throw UsageError("decode_bytes takes integer token ids, not " +
                     std::string(c10::toString(tokens.scalar_type())));
  }
  const auto ids = tokens.reshape({-1}).to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  std::string text(static_cast<size_t>(ids.numel()), '\0');
  for (int64_t k = 0; k < ids.numel(); ++k) {
    if (p[k] < 0 || p[k] > 255) {
      throw UsageError("token id " + std::to_string(p[k]) + " at position " + std::to_string(k) +
                       " is not a byte (0..255): decode_bytes reads byte tokens "
                       "(write_byte_tokens); another vocabulary needs its own decoder");
    }
    text[static_cast<size_t>(k)] = static_cast<char>(p[k]);
  }
  return text;
}

}  // namespace scaletrain
