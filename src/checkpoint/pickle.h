#pragma once
// Python pickles without Python (internal): a writer of the few opcodes PyTorch's checkpoint
// files need, and a restricted reader that executes nothing (Note [Restricted unpickler] in
// pickle.cpp). The reader turns a pickle into a tree of plain values: a class is a name checked
// against an allow-list, and "calling" it (REDUCE, NEWOBJ) only records the name and the
// arguments; what they mean is for the caller to decide (dcp_metadata.cpp, dcp_payload.cpp).
// LibTorch-free.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace scaletrain::pickle {

struct Value;
using Ref = std::shared_ptr<const Value>;

struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kTuple,
    kList,
    kDict,
    kGlobal,        // a class or function named by GLOBAL / STACK_GLOBAL: text = "module.name"
    kObject,        // made by REDUCE or NEWOBJ: text = its class, items = the arguments
    kPersistentId,  // BINPERSID: items = {the id}
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;                          // string, bytes, global's or object's name
  std::vector<Ref> items;                    // tuple, list; object's arguments
  std::vector<std::pair<Ref, Ref>> entries;  // dict, in the pickle's order
  Ref state;                                 // object: what BUILD gave it (nullptr: none)
  int depth = 1;                             // nesting, 1 for a leaf
  bool shared = false;                       // fetched from the memo: no longer mutable

  bool is(Kind k) const { return kind == k; }
  /// The dict entry whose key is the string `key`; nullptr when there is none.
  Ref get(const std::string& key) const;
};

struct ReadOptions {
  std::string source;                     // the file, named in every error
  std::string what = "pickle";            // what the file should be ("DCP metadata")
  std::set<std::string> allowed_globals;  // "module.name" of each class the file may name
  bool persistent_ids = false;            // BINPERSID (torch.save's storages)
  int max_depth = 64;                     // nesting refused beyond this
};

/// Reads one pickle (protocols 2-5, the binary opcodes PyTorch's files use). Throws Error naming
/// options.source for a damaged or foreign pickle: an opcode it does not know, a class not in
/// the allow-list, a truncated file, a structure nested deeper than max_depth or recursive.
Ref read(std::string_view bytes, const ReadOptions& options);

/// A short description of a value for messages ("a dict", "the string 'x'", "posix.system").
std::string describe(const Value& v);

/// Writes a protocol-2 pickle opcode by opcode. Globals are memoized (written once, fetched
/// after). The caller keeps the stack consistent, as Python's pickler would.
class Writer {
 public:
  Writer();
  void none();
  void boolean(bool b);
  void integer(int64_t i);
  void real(double d);
  void string(const std::string& s);
  void global(const std::string& module, const std::string& name);
  void mark();
  /// A tuple of the top `n` values (n <= 3), or of the values since the last mark (n < 0).
  void tuple(int n);
  void empty_dict();
  void setitems();  // the key-value pairs since the last mark into the dict below the mark
  void empty_list();
  void appends();  // the values since the last mark into the list below the mark
  void reduce();   // callable, args tuple -> callable(*args)
  void newobj();   // class, args tuple -> class.__new__(class, *args)
  void build();    // object, state -> object with that state
  void persistent_id();
  /// STOP, and the bytes.
  std::string finish();

 private:
  void put(uint8_t op);
  void u32(uint32_t v);
  std::string out_;
  std::map<std::string, uint32_t> memo_;
};

}  // namespace scaletrain::pickle
