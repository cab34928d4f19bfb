// Note [DCP layout]
// PyTorch's distributed checkpoint (torch.distributed.checkpoint, "DCP"; 2.11's metadata.py and
// filesystem.py) is a folder:
//
//   .metadata          a pickle of Metadata, written by the coordinator (rank 0) last
//   __<rank>_0.distcp  each rank's items, one after another
//
// Metadata's state is a dict:
//   state_dict_metadata  {key: TensorStorageMetadata | BytesStorageMetadata}. A key is the
//                        state dict's key flattened with '.' ("model.fc.weight",
//                        "optim.state.fc.weight.exp_avg", "optim.param_groups.0.lr").
//                        TensorStorageMetadata: properties (TensorProperties, whose state is the
//                        tuple (dtype, layout, requires_grad, memory format enum, pin_memory)),
//                        size (torch.Size, the global shape), chunks (a list of
//                        ChunkStorageMetadata: offsets and sizes, torch.Size each: the boxes the
//                        ranks saved, Note [Boxes]). BytesStorageMetadata has no fields: the item
//                        is any object, torch.save'd.
//   planner_data         {key: (path, of, nested, keys)}: what dcp_to_torch_save nests again.
//   storage_data         {MetadataIndex(fqn, offset = the chunk's offsets, or None for bytes,
//                        index = a hint): _StorageInfo(relative_path, offset, length)}.
//   storage_meta         StorageMeta(checkpoint_id, save_id, load_id, modules).
//   version              "1.0.0".
//
// Python pickles the dataclasses with NEWOBJ and a BUILD of their __dict__, torch.Size with
// REDUCE of a tuple, a dtype as the global torch.<name>, the layout as
// torch.serialization._get_layout("torch.strided"), the enum as _MEM_FORMAT_ENCODING(0). We
// write the same objects (protocol 2 rather than Python's 4; any Python reads both). Reading
// goes through the restricted reader (Note [Restricted unpickler]) with exactly these classes
// allowed, and checks each field's shape; a file that holds anything else is refused by name.

#include "checkpoint/dcp_metadata.h"

#include <set>

#include "checkpoint/pickle.h"
#include "scaletrain/error.h"

namespace scaletrain::dcp {
namespace {

using pickle::Ref;
using pickle::Value;
using Kind = pickle::Value::Kind;

const char* const kMd = "torch.distributed.checkpoint.metadata";
const char* const kFs = "torch.distributed.checkpoint.filesystem";

const std::set<std::string>& allowed_globals() {
  static const std::set<std::string> s = [] {
    std::set<std::string> a;
    for (const char* c :
         {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}) {
      a.insert(std::string(kMd) + "." + c);
    }
    a.insert(std::string(kFs) + "._StorageInfo");
    for (const auto& d : known_dtypes()) a.insert("torch." + d);
    for (const char* g : {"torch.Size", "torch.strided", "torch.serialization._get_layout",
                          "pathlib.PosixPath", "pathlib.PurePosixPath"}) {
      a.insert(g);
    }
    return a;
  }();
  return s;
}

// --- writing ---

void torch_size(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.global("torch", "Size");
  w.mark();
  for (int64_t x : v) w.integer(x);
  w.tuple(-1);
  w.tuple(1);
  w.reduce();
}

// A dataclass as Python pickles it: cls.__new__(cls), then BUILD of a dict written by `fields`.
template <typename Fields>
void dataclass(pickle::Writer& w, const char* module, const char* cls, Fields fields) {
  w.global(module, cls);
  w.tuple(0);
  w.newobj();
  w.empty_dict();
  w.mark();
  fields();
  w.setitems();
  w.build();
}

void tensor_properties(pickle::Writer& w, const std::string& dtype) {
  w.global(kMd, "TensorProperties");
  w.tuple(0);
  w.newobj();
  w.mark();  // its __getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
  w.global("torch", dtype);
  w.global("torch.serialization", "_get_layout");
  w.string("torch.strided");
  w.tuple(1);
  w.reduce();
  w.boolean(false);
  w.global(kMd, "_MEM_FORMAT_ENCODING");
  w.integer(0);  // TORCH_CONTIGUOUS_FORMAT
  w.tuple(1);
  w.reduce();
  w.boolean(false);
  w.tuple(-1);
  w.build();
}

void tensor_entry(pickle::Writer& w, const TensorEntry& t) {
  dataclass(w, kMd, "TensorStorageMetadata", [&] {
    w.string("properties");
    tensor_properties(w, t.dtype);
    w.string("size");
    torch_size(w, t.shape);
    w.string("chunks");
    w.empty_list();
    w.mark();
    for (const auto& c : t.chunks) {
      dataclass(w, kMd, "ChunkStorageMetadata", [&] {
        w.string("offsets");
        torch_size(w, c.box.offsets);
        w.string("sizes");
        torch_size(w, c.box.sizes);
      });
    }
    w.appends();
  });
}

void storage_entry(pickle::Writer& w, const std::string& fqn, const std::vector<int64_t>* offsets,
                   int64_t index, const StorageInfo& s) {
  dataclass(w, kMd, "MetadataIndex", [&] {
    w.string("fqn");
    w.string(fqn);
    w.string("index");
    offsets ? w.integer(index) : w.none();
    if (offsets) {
      w.string("offset");
      torch_size(w, *offsets);
    }
  });
  dataclass(w, kFs, "_StorageInfo", [&] {
    w.string("relative_path");
    w.string(s.relative_path);
    w.string("offset");
    w.integer(s.offset);
    w.string("length");
    w.integer(s.length);
  });
}

void planner_data(pickle::Writer& w, const Metadata& m, const std::string& key) {
  w.string(key);
  auto it = m.paths.find(key);
  const std::vector<std::string> path =
      it == m.paths.end() || it->second.empty() ? std::vector<std::string>{key} : it->second;
  w.mark();
  for (const auto& part : path) {
    const bool index = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    index ? w.integer(std::stoll(part)) : w.string(part);
  }
  w.tuple(-1);
}

// --- reading ---

class Decoder {
 public:
  explicit Decoder(std::string source) : source_(std::move(source)) {}
  Metadata run(std::string_view bytes);

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw Error("cannot read DCP metadata '" + source_ + "': " + why +
                "; is it a .metadata written by torch.distributed.checkpoint?");
  }
  // `v` is an object of class `cls` (of torch.distributed.checkpoint.metadata unless dotted).
  const Value& object(const Ref& v, const std::string& cls, const std::string& where) const {
    const std::string full =
        cls.find('.') == std::string::npos ? std::string(kMd) + "." + cls : cls;
    if (!v || !v->is(Kind::kObject) || v->text != full) {
      fail(where + " is " + (v ? pickle::describe(*v) : "missing") + ", not a " + full);
    }
    return *v;
  }
  // The dict an object was BUILT with.
  const Value& state(const Value& obj, const std::string& where) const {
    if (!obj.state || !obj.state->is(Kind::kDict)) fail(where + " has no fields");
    return *obj.state;
  }
  Ref field(const Value& dict, const std::string& key, const std::string& where) const {
    Ref v = dict.get(key);
    if (!v) fail(where + " has no '" + key + "'");
    return v;
  }
  const std::string& text(const Ref& v, const std::string& where) const {
    if (!v || !v->is(Kind::kString)) fail(where + " is not a string");
    return v->text;
  }
  int64_t integer(const Ref& v, const std::string& where) const {
    if (!v || !v->is(Kind::kInt)) fail(where + " is not an integer");
    return v->integer;
  }
  std::vector<int64_t> size(const Ref& v, const std::string& where) const;
  std::string dtype(const Value& properties, const std::string& where) const;
  TensorEntry tensor(const Ref& v, const std::string& key) const;
  void storage(const Ref& index, const Ref& info, Metadata& m) const;

  std::string source_;
};

// A torch.Size (REDUCE of a tuple of ints), or a plain tuple of ints.
std::vector<int64_t> Decoder::size(const Ref& v, const std::string& where) const {
  Ref t = v;
  if (t && t->is(Kind::kObject) && t->text == "torch.Size" && t->items.size() == 1) t = t->items[0];
  if (!t || !t->is(Kind::kTuple)) fail(where + " is not a torch.Size");
  std::vector<int64_t> out;
  for (const auto& x : t->items) out.push_back(integer(x, where + "'s entries"));
  return out;
}

std::string Decoder::dtype(const Value& properties, const std::string& where) const {
  const Ref& st = properties.state;
  if (!st || !st->is(Kind::kTuple) || st->items.size() != 5)
    fail(where + " has no properties tuple");
  const Ref& d = st->items[0];
  if (!d->is(Kind::kGlobal) || d->text.rfind("torch.", 0) != 0) fail(where + " has no dtype");
  const Ref& layout = st->items[1];
  const bool strided =
      (layout->is(Kind::kGlobal) && layout->text == "torch.strided") ||
      (layout->is(Kind::kObject) && layout->text == "torch.serialization._get_layout" &&
       layout->items.size() == 1 && layout->items[0]->text == "torch.strided");
  if (!strided) fail(where + " has a layout other than torch.strided (a sparse tensor)");
  return d->text.substr(6);  // the allow-list holds only known_dtypes()
}

TensorEntry Decoder::tensor(const Ref& v, const std::string& key) const {
  const std::string where = "tensor '" + key + "'";
  const Value& st = state(object(v, "TensorStorageMetadata", where), where);
  TensorEntry t;
  t.dtype = dtype(object(field(st, "properties", where), "TensorProperties", where), where);
  t.shape = size(field(st, "size", where), where + "'s size");
  Ref chunks = field(st, "chunks", where);
  if (!chunks->is(Kind::kList)) fail(where + "'s chunks are not a list");
  for (const auto& c : chunks->items) {
    const Value& cs = state(object(c, "ChunkStorageMetadata", where + "'s chunk"), where);
    Chunk chunk;
    chunk.box.offsets = size(field(cs, "offsets", where), where + "'s chunk offsets");
    chunk.box.sizes = size(field(cs, "sizes", where), where + "'s chunk sizes");
    try {
      check_box(key, t.shape, chunk.box, "a chunk");
    } catch (const Error& e) {
      fail(e.what());
    }
    t.chunks.push_back(std::move(chunk));
  }
  return t;
}

void Decoder::storage(const Ref& index, const Ref& info, Metadata& m) const {
  const Value& is = state(object(index, "MetadataIndex", "a storage key"), "a storage key");
  const std::string& fqn = text(field(is, "fqn", "a storage key"), "a storage key's fqn");
  const std::string where = "the storage of '" + fqn + "'";
  const Value& ss = state(object(info, std::string(kFs) + "._StorageInfo", where), where);
  StorageInfo s;
  s.relative_path = text(field(ss, "relative_path", where), where + "'s path");
  s.offset = integer(field(ss, "offset", where), where + "'s offset");
  s.length = integer(field(ss, "length", where), where + "'s length");
  if (s.relative_path.empty() || s.relative_path.find('/') != std::string::npos ||
      s.relative_path == "." || s.relative_path == ".." || s.offset < 0 || s.length <= 0) {
    fail(where + " is '" + s.relative_path + "' [" + std::to_string(s.offset) + ", +" +
         std::to_string(s.length) + "), not a byte range of a file in the folder");
  }
  Ref transforms = ss.get("transform_descriptors");
  if (transforms && !transforms->is(Kind::kNone) && !transforms->items.empty())
    fail(where + " is transformed (compressed); scaletrain reads plain items only");
  if (m.values.count(fqn)) {
    m.values[fqn] = s;
    return;
  }
  auto t = m.tensors.find(fqn);
  Ref offset = is.get("offset");
  if (t == m.tensors.end() || !offset || offset->is(Kind::kNone)) return;  // not a tensor chunk
  const auto offsets = size(offset, where + "'s offset");
  auto& chunks = t->second.chunks;
  Ref hint = is.get("index");  // where the chunk is in the list, when the writer says so
  if (hint && hint->is(Kind::kInt) && hint->integer >= 0 &&
      static_cast<size_t>(hint->integer) < chunks.size() &&
      chunks[static_cast<size_t>(hint->integer)].box.offsets == offsets) {
    chunks[static_cast<size_t>(hint->integer)].storage = s;
    return;
  }
  for (auto& c : chunks) {
    if (c.box.offsets == offsets) c.storage = s;
  }
}

Metadata Decoder::run(std::string_view bytes) {
  pickle::ReadOptions o;
  o.source = source_;
  o.what = "DCP metadata";
  o.allowed_globals = allowed_globals();
  Ref root = pickle::read(bytes, o);
  const Value& st = state(object(root, "Metadata", "the file"), "the Metadata");
  Metadata m;
  Ref entries = field(st, "state_dict_metadata", "the Metadata");
  if (!entries->is(Kind::kDict)) fail("state_dict_metadata is not a dict");
  for (const auto& [k, v] : entries->entries) {
    const std::string& key = text(k, "a key of state_dict_metadata");
    if (v->is(Kind::kObject) && v->text == std::string(kMd) + ".BytesStorageMetadata") {
      m.values[key] = StorageInfo{};
    } else {
      m.tensors[key] = tensor(v, key);
    }
  }
  Ref storage_data = field(st, "storage_data", "the Metadata");
  if (!storage_data->is(Kind::kDict)) fail("storage_data is not a dict");
  for (const auto& [index, info] : storage_data->entries) storage(index, info, m);
  for (const auto& [key, t] : m.tensors) {
    for (const auto& c : t.chunks) {
      if (c.storage.relative_path.empty())
        fail("chunk " + describe(c.box) + " of '" + key + "' has no storage entry");
    }
  }
  for (const auto& [key, s] : m.values) {
    if (s.relative_path.empty()) fail("'" + key + "' has no storage entry");
  }
  Ref version = st.get("version");
  if (version && version->is(Kind::kString)) m.version = version->text;
  return m;
}

}  // namespace

const std::vector<std::string>& known_dtypes() {
  static const std::vector<std::string> d = {"float64", "float32", "float16", "bfloat16", "int64",
                                             "int32",   "int16",   "int8",    "uint8",    "bool"};
  return d;
}

std::string encode_metadata(const Metadata& m, const std::string& save_id) {
  pickle::Writer w;
  dataclass(w, kMd, "Metadata", [&] {
    w.string("state_dict_metadata");
    w.empty_dict();
    w.mark();
    for (const auto& [key, t] : m.tensors) w.string(key), tensor_entry(w, t);
    for (const auto& kv : m.values) {
      w.string(kv.first);
      w.global(kMd, "BytesStorageMetadata");
      w.tuple(0);
      w.newobj();
    }
    w.setitems();
    w.string("planner_data");
    w.empty_dict();
    w.mark();
    for (const auto& kv : m.tensors) planner_data(w, m, kv.first);
    for (const auto& kv : m.values) planner_data(w, m, kv.first);
    w.setitems();
    w.string("storage_data");
    w.empty_dict();
    w.mark();
    for (const auto& [key, t] : m.tensors) {
      for (size_t i = 0; i < t.chunks.size(); ++i) {
        storage_entry(w, key, &t.chunks[i].box.offsets, static_cast<int64_t>(i),
                      t.chunks[i].storage);
      }
    }
    for (const auto& [key, s] : m.values) storage_entry(w, key, nullptr, 0, s);
    w.setitems();
    w.string("storage_meta");
    dataclass(w, kMd, "StorageMeta", [&] {
      w.string("checkpoint_id"), w.none();
      w.string("save_id"), w.string(save_id);
      w.string("load_id"), w.none();
      w.string("modules"), w.empty_list();
    });
    w.string("version");
    w.string(m.version.empty() ? "1.0.0" : m.version);
  });
  return w.finish();
}

Metadata decode_metadata(std::string_view bytes, const std::string& source) {
  return Decoder(source).run(bytes);
}

}  // namespace scaletrain::dcp
