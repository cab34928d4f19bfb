// Reading a DCP folder at any layout (distributed_checkpoint.h): the metadata through the
// restricted reader (Note [DCP layout]), each wanted box planned against the saved chunks (Note
// [Boxes]), each chunk's item read from its file's byte range and decoded (Note [DCP items]).
// Nothing is collective: every rank reads the chunks its own boxes need.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_payload.h"
#include "scaletrain/distributed_checkpoint.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

// One checkpoint folder being read: its metadata, and its files opened once each.
class Folder {
 public:
  explicit Folder(std::string dir) : dir_(std::move(dir)) {
    const std::string path = dir_ + "/.metadata";
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      throw Error("'" + dir_ + "' holds no readable .metadata (" + std::strerror(errno) +
                  "): it is not a distributed checkpoint folder, or its save did not finish");
    }
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    meta_ = dcp::decode_metadata(bytes, path);
  }
  ~Folder() {
    for (auto& kv : files_) ::close(kv.second.first);
  }
  Folder(const Folder&) = delete;
  Folder& operator=(const Folder&) = delete;

  const dcp::Metadata& meta() const { return meta_; }

  // The bytes of one item, `what` naming it in errors.
  std::string item(const dcp::StorageInfo& s, const std::string& what) {
    const std::string path = dir_ + "/" + s.relative_path;
    auto it = files_.find(s.relative_path);
    if (it == files_.end()) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      struct stat st {};
      if (fd < 0 || ::fstat(fd, &st) != 0) {
        throw Error("cannot read '" + path + "' (" + std::strerror(errno) + "), which holds " +
                    what + ": the checkpoint folder is incomplete");
      }
      it = files_.emplace(s.relative_path, std::make_pair(fd, int64_t{st.st_size})).first;
    }
    const auto [fd, size] = it->second;
    if (s.offset + s.length > size) {
      throw Error("'" + path + "' is truncated: " + what + " lies at bytes [" +
                  std::to_string(s.offset) + ", " + std::to_string(s.offset + s.length) +
                  ") and the file has " + std::to_string(size));
    }
    std::string bytes(static_cast<size_t>(s.length), '\0');
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done,
                                static_cast<off_t>(s.offset) + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw Error("reading '" + path + "' failed (" + std::strerror(errno) + ")");
      done += static_cast<size_t>(n);
    }
    return bytes;
  }

  // Chunk `c` of tensor `name`, checked against its metadata.
  at::Tensor chunk(const std::string& name, const dcp::TensorEntry& t, size_t c) {
    const dcp::Chunk& ch = t.chunks[c];
    const std::string what = "the chunk " + describe(ch.box) + " of '" + name + "'";
    const std::string where = what + " in '" + dir_ + "/" + ch.storage.relative_path + "' (bytes " +
                              std::to_string(ch.storage.offset) + "+" +
                              std::to_string(ch.storage.length) + ")";
    at::Tensor v = dcp::read_tensor_item(item(ch.storage, what), where);
    const at::ScalarType want = dcp::scalar_type(t.dtype, "'" + name + "'");
    if (v.sizes().vec() != ch.box.sizes || v.scalar_type() != want) {
      throw Error("cannot read " + where + ": it holds a " +
                  std::string(c10::toString(v.scalar_type())) + " tensor of shape " +
                  c10::str(v.sizes()) + " where the metadata says " + t.dtype + " " +
                  describe(whole(ch.box.sizes)));
    }
    return v;
  }

 private:
  std::string dir_;
  dcp::Metadata meta_;
  std::map<std::string, std::pair<int, int64_t>> files_;  // relative path -> (fd, size)
};

at::Tensor view(at::Tensor t, const Box& b) {
  for (size_t d = 0; d < b.offsets.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  return t;
}

std::string list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 5; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 5) s += " and " + std::to_string(names.size() - 5) + " more";
  return s;
}

// Every box's key is in the folder with the box's global shape: else one error naming them all.
void check_keys(const std::string& dir, const dcp::Metadata& m,
                const std::vector<TensorBox>& boxes) {
  std::vector<std::string> missing, shapes;
  for (const auto& b : boxes) {
    auto it = m.tensors.find(b.key.name);
    if (it == m.tensors.end()) {
      missing.push_back(b.key.name);
    } else if (it->second.shape != b.global_shape) {
      shapes.push_back(b.key.name + " (saved " + c10::str(at::IntArrayRef(it->second.shape)) +
                       ", wanted " + c10::str(at::IntArrayRef(b.global_shape)) + ")");
    }
  }
  if (missing.empty() && shapes.empty()) return;
  std::string msg = "the checkpoint '" + dir + "' does not hold what is asked of it:";
  if (!missing.empty()) msg += " missing keys: " + list(missing) + ";";
  if (!shapes.empty()) msg += " other global shapes: " + list(shapes) + ";";
  throw Error(msg + " was it saved from another model or with other options?");
}

void load(Folder& f, const std::string& dir, std::vector<TensorBox>& boxes) {
  check_keys(dir, f.meta(), boxes);
  for (auto& b : boxes) {
    const dcp::TensorEntry& t = f.meta().tensors.at(b.key.name);
    const Box want{b.offsets.empty() ? std::vector<int64_t>(b.global_shape.size(), 0) : b.offsets,
                   b.tensor.sizes().vec()};
    std::vector<Box> chunks;
    for (const auto& c : t.chunks) chunks.push_back(c.box);
    at::NoGradGuard no_grad;
    for (const BoxRead& r : plan_box_reads(b.key.name, t.shape, chunks, want)) {
      view(b.tensor, r.dest).copy_(view(f.chunk(b.key.name, t, r.chunk), r.source));
    }
  }
}

}  // namespace

DcpContents read_distributed_checkpoint_contents(const std::string& dir) {
  Folder f(dir);
  DcpContents out;
  for (const auto& [name, t] : f.meta().tensors) {
    DcpTensorInfo& info = out.tensors[name];
    info.dtype = dcp::scalar_type(t.dtype, "'" + name + "'");
    info.shape = t.shape;
    for (const auto& c : t.chunks) info.chunks.push_back(c.box);
  }
  for (const auto& kv : f.meta().values) out.values.push_back(kv.first);
  return out;
}

void load_distributed_checkpoint(const std::string& dir, std::vector<TensorBox>& boxes) {
  Folder f(dir);
  load(f, dir, boxes);
}

std::map<std::string, at::Tensor> load_distributed_checkpoint_tensors(const std::string& dir,
                                                                      const std::string& prefix) {
  Folder f(dir);
  std::vector<TensorBox> boxes;
  for (const auto& [name, t] : f.meta().tensors) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto type = dcp::scalar_type(t.dtype, "'" + name + "'");
    boxes.push_back({{name, {}}, at::empty(t.shape, at::TensorOptions().dtype(type)), t.shape, {}});
  }
  load(f, dir, boxes);
  std::map<std::string, at::Tensor> out;
  for (auto& b : boxes) out[b.key.name.substr(prefix.size())] = b.tensor;
  return out;
}

std::map<std::string, DcpValue> load_distributed_checkpoint_values(const std::string& dir) {
  Folder f(dir);
  std::map<std::string, DcpValue> out;
  for (const auto& [name, s] : f.meta().values) {
    const std::string what = "the value '" + name + "'";
    out[name] = dcp::read_value_item(f.item(s, what), what + " in '" + dir + "/" + s.relative_path +
                                                          "' (bytes " + std::to_string(s.offset) +
                                                          "+" + std::to_string(s.length) + ")");
  }
  return out;
}

}  // namespace scaletrain
