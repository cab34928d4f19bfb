// Note [DCP items]
// 2.11's FileSystemWriter (filesystem.py, _write_item) writes each item of a rank's file as a
// whole torch.save archive, one after another, and records each one's byte range in the
// metadata's storage_data; FileSystemReader hands torch.load (weights_only) that range of the
// file. A tensor chunk is saved after a clone that makes its storage exactly its bytes, so an
// item's zip holds
//
//   archive/data.pkl             torch._utils._rebuild_tensor_v2(
//                                    persistent_id(("storage", torch.FloatStorage, "0", "cpu",
//                                                   numel)),
//                                    storage offset 0, size, stride, requires_grad False,
//                                    collections.OrderedDict())
//   archive/.format_version      "1"
//   archive/.storage_alignment   "64"
//   archive/byteorder            "little"
//   archive/data/0               the numel × element size bytes
//   archive/version, archive/.data/serialization_id  (added by the zip writer itself)
//
// with every record's data 64-byte aligned inside the zip. A value (BytesStorageMetadata: an
// int, a string, a tuple of floats...) is the same archive with only the pickle of the object.
// We write exactly these records with LibTorch's zip writer (PyTorchStreamWriter, the one
// Python's torch.save drives) and our own pickle (pickle.h), and read them with LibTorch's zip
// reader and the restricted unpickler: the tensor's pickle may name only the rebuild function,
// the storage classes and OrderedDict, a value's no class at all.

#include "checkpoint/dcp_payload.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "checkpoint/pickle.h"
#include "scaletrain/error.h"

namespace scaletrain::dcp {
namespace {

using pickle::Ref;
using Kind = pickle::Value::Kind;

struct DtypeName {
  const char* name;
  at::ScalarType type;
  const char* storage;
};

const std::vector<DtypeName>& dtypes() {
  static const std::vector<DtypeName> d = {
      {"float64", at::kDouble, "DoubleStorage"}, {"float32", at::kFloat, "FloatStorage"},
      {"float16", at::kHalf, "HalfStorage"},     {"bfloat16", at::kBFloat16, "BFloat16Storage"},
      {"int64", at::kLong, "LongStorage"},       {"int32", at::kInt, "IntStorage"},
      {"int16", at::kShort, "ShortStorage"},     {"int8", at::kChar, "CharStorage"},
      {"uint8", at::kByte, "ByteStorage"},       {"bool", at::kBool, "BoolStorage"}};
  return d;
}

// A zip archive of torch.save's records around `pickle` and, for a tensor, its bytes.
std::string archive(const std::string& pickle, const void* data, size_t nbytes, bool tensor) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* b, size_t n) {
    out.append(static_cast<const char*>(b), n);
    return n;
  });
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeRecord(".format_version", "1", 1);
  writer.writeRecord(".storage_alignment", "64", 2);
  writer.writeRecord("byteorder", "little", 6);
  if (tensor) writer.writeRecord("data/0", data, nbytes);
  writer.writeEndOfFile();
  return out;
}

void write_value(pickle::Writer& w, const DcpValue& v) {
  switch (v.kind) {
    case DcpValue::Kind::kNone:
      return w.none();
    case DcpValue::Kind::kBool:
      return w.boolean(v.boolean);
    case DcpValue::Kind::kInt:
      return w.integer(v.integer);
    case DcpValue::Kind::kFloat:
      return w.real(v.real);
    case DcpValue::Kind::kString:
      return w.string(v.text);
    case DcpValue::Kind::kList:
      w.empty_list();
      w.mark();
      for (const auto& i : v.items) write_value(w, i);
      return w.appends();
    case DcpValue::Kind::kTuple:
      w.mark();
      for (const auto& i : v.items) write_value(w, i);
      return w.tuple(-1);
  }
}

class MemoryAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MemoryAdapter(std::string_view bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  std::string_view bytes_;
};

struct Records {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::string pickle;
};

Records open_archive(std::string_view bytes, const std::string& where) {
  Records r;
  try {
    r.zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<MemoryAdapter>(bytes));
    if (r.zip->hasRecord("byteorder")) {
      auto [order, n] = r.zip->getRecord("byteorder");
      if (std::string(static_cast<const char*>(order.get()), n) != "little")
        throw Error("it was saved on a big-endian machine");
    }
    auto [data, n] = r.zip->getRecord("data.pkl");
    r.pickle.assign(static_cast<const char*>(data.get()), n);
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw Error("cannot read " + where + ": not a torch.save archive (" + why +
                "); the file is damaged or truncated");
  }
  return r;
}

std::vector<int64_t> ints(const Ref& v, const std::string& where) {
  if (!v || !v->is(Kind::kTuple))
    throw Error("cannot read " + where + ": a tensor's shape is " +
                (v ? pickle::describe(*v) : "missing"));
  std::vector<int64_t> out;
  for (const auto& x : v->items) {
    if (!x->is(Kind::kInt)) throw Error("cannot read " + where + ": a shape holds a non-integer");
    out.push_back(x->integer);
  }
  return out;
}

DcpValue to_value(const pickle::Value& v, const std::string& where) {
  switch (v.kind) {
    case Kind::kNone:
      return DcpValue{};
    case Kind::kBool:
      return DcpValue::of(v.boolean);
    case Kind::kInt:
      return DcpValue::of(v.integer);
    case Kind::kFloat:
      return DcpValue::of(v.real);
    case Kind::kString:
      return DcpValue::of(v.text);
    case Kind::kList:
    case Kind::kTuple: {
      std::vector<DcpValue> items;
      for (const auto& i : v.items) items.push_back(to_value(*i, where));
      return v.is(Kind::kList) ? DcpValue::list(std::move(items))
                               : DcpValue::tuple(std::move(items));
    }
    default:
      throw Error("cannot read " + where + ": it holds " + pickle::describe(v) +
                  "; values here are None, bools, ints, floats, strings, lists and tuples");
  }
}

}  // namespace

at::ScalarType scalar_type(const std::string& name, const std::string& where) {
  for (const auto& d : dtypes()) {
    if (name == d.name) return d.type;
  }
  throw Error(where + " has dtype torch." + name + ", which scaletrain does not read");
}

std::string dtype_name(at::ScalarType t, const std::string& where) {
  for (const auto& d : dtypes()) {
    if (t == d.type) return d.name;
  }
  throw UsageError(where + " has dtype " + std::string(c10::toString(t)) +
                   ", which a checkpoint here cannot hold; convert it to a real dtype of "
                   "float64, float32, float16, bfloat16, int64, int32, int16, int8, uint8, bool");
}

std::string tensor_item(const at::Tensor& t) {
  const std::string name = dtype_name(t.scalar_type(), "a tensor");
  const char* storage = "";
  for (const auto& d : dtypes()) {
    if (t.scalar_type() == d.type) storage = d.storage;
  }
  pickle::Writer w;
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.mark();
  w.mark();  // the persistent id of the storage
  w.string("storage");
  w.global("torch", storage);
  w.string("0");
  w.string("cpu");
  w.integer(t.numel());
  w.tuple(-1);
  w.persistent_id();
  w.integer(0);  // storage offset
  w.mark();
  for (int64_t s : t.sizes()) w.integer(s);
  w.tuple(-1);
  w.mark();
  for (int64_t s : t.strides()) w.integer(s);
  w.tuple(-1);
  w.boolean(false);                        // requires_grad
  w.global("collections", "OrderedDict");  // backward hooks: none
  w.tuple(0);
  w.reduce();
  w.tuple(-1);
  w.reduce();
  return archive(w.finish(), t.data_ptr(), t.nbytes(), /*tensor=*/true);
}

std::string value_item(const DcpValue& v) {
  pickle::Writer w;
  write_value(w, v);
  return archive(w.finish(), nullptr, 0, /*tensor=*/false);
}

at::Tensor read_tensor_item(std::string_view bytes, const std::string& where) {
  Records r = open_archive(bytes, where);
  pickle::ReadOptions o;
  o.source = where;
  o.what = "torch.save'd tensor";
  o.persistent_ids = true;
  o.allowed_globals = {"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"};
  for (const auto& d : dtypes()) o.allowed_globals.insert(std::string("torch.") + d.storage);
  Ref v = pickle::read(r.pickle, o);
  auto bad = [&](const std::string& why) { return Error("cannot read " + where + ": " + why); };
  if (!v->is(Kind::kObject) || v->text != "torch._utils._rebuild_tensor_v2" || v->items.size() < 5)
    throw bad("it holds " + pickle::describe(*v) + ", not a tensor");
  const Ref& pid = v->items[0];
  if (!pid->is(Kind::kPersistentId) || !pid->items[0]->is(Kind::kTuple) ||
      pid->items[0]->items.size() != 5)
    throw bad("its tensor has no storage");
  const auto& id = pid->items[0]->items;
  std::optional<at::ScalarType> type;
  for (const auto& d : dtypes()) {
    if (id[1]->is(Kind::kGlobal) && id[1]->text == std::string("torch.") + d.storage) type = d.type;
  }
  if (!type || !id[2]->is(Kind::kString) || !id[4]->is(Kind::kInt) || !v->items[1]->is(Kind::kInt))
    throw bad("its storage's key or size is missing");
  const int64_t numel = id[4]->integer, offset = v->items[1]->integer;
  const auto size = ints(v->items[2], where), stride = ints(v->items[3], where);
  at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(*type));
  try {
    auto [data, n] = r.zip->getRecord("data/" + id[2]->text);
    if (n != storage.nbytes())
      throw Error(std::to_string(n) + " bytes for " + std::to_string(storage.nbytes()));
    std::memcpy(storage.data_ptr(), data.get(), n);
  } catch (const std::exception& e) {
    throw bad(std::string("its storage cannot be read (") + e.what() + ")");
  }
  int64_t last = offset;  // the last element the view reaches
  for (size_t d = 0; d < size.size() && d < stride.size(); ++d) {
    if (size[d] == 0) last = -1;
    if (last >= 0) last += (size[d] - 1) * stride[d];
  }
  if (size.size() != stride.size() || offset < 0 || last >= numel ||
      std::any_of(stride.begin(), stride.end(), [](int64_t s) { return s < 0; }))
    throw bad("its shape and strides reach past its storage");
  return storage.as_strided(size, stride, offset);
}

DcpValue read_value_item(std::string_view bytes, const std::string& where) {
  Records r = open_archive(bytes, where);
  pickle::ReadOptions o;
  o.source = where;
  o.what = "torch.save'd value";
  return to_value(*pickle::read(r.pickle, o), where);
}

}  // namespace scaletrain::dcp
