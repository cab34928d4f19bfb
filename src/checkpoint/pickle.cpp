// Note [Restricted unpickler]
// A pickle is a program for a small stack machine: most opcodes push values, and three of them
// run code — GLOBAL / STACK_GLOBAL import any attribute of any module, REDUCE calls it, BUILD
// calls __setstate__. Python's pickle.load runs them, so a file may start a shell. This reader
// runs nothing. A global is only a name, refused unless the caller's allow-list holds it; REDUCE
// and NEWOBJ make an "object" that records the callable's name and its arguments; BUILD records
// the state. The caller (the DCP metadata decoder, the torch.save item decoder) then checks the
// tree's shape field by field and reads what it needs.
//
// What else a hostile file could do, and what stops it:
//  - cycles (a list that holds itself, through the memo): a value fetched from the memo becomes
//    immutable, and only such a fetch can put a container inside itself, so no cycle is built;
//  - deep nesting (a million TUPLE1s), which would overflow the stack of a recursive reader or
//    destructor: every value knows its depth, and one past max_depth is refused;
//  - lengths past the end of the file, memo indices never stored, opcodes of text protocols,
//    LONG4 and integers past 64 bits, a STOP with anything but one value on the stack: refused.
// Every error names the file, the byte offset and what was found.

#include "checkpoint/pickle.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "scaletrain/error.h"

namespace scaletrain::pickle {
namespace {

using Mut = std::shared_ptr<Value>;

class Machine {
 public:
  Machine(std::string_view bytes, const ReadOptions& o) : in_(bytes), o_(o) {}
  Ref run();

 private:
  [[noreturn]] void fail(const std::string& why) const;
  std::string_view take(size_t n);
  uint64_t uint(size_t n);
  std::string line();
  Mut pop();
  Mut top();
  std::vector<Mut> pop_mark();
  Mut leaf(Value::Kind k);
  Mut container(Value::Kind k, std::vector<Mut> items);
  void adopt(Value& parent, const Ref& child);
  void push_global(const std::string& module, const std::string& name);
  void mutate_check(const Value& v, const char* op) const;
  void memo_put(uint64_t index);
  void memo_get(uint64_t index);
  bool step(uint8_t op);
  bool step_value(uint8_t op);
  bool step_structure(uint8_t op);

  std::string_view in_;
  size_t pos_ = 0, op_pos_ = 0;
  const ReadOptions& o_;
  std::vector<Mut> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, Mut> memo_;
};

void Machine::fail(const std::string& why) const {
  throw Error("cannot read " + o_.what + " '" + o_.source + "': " + why + " (at byte " +
              std::to_string(op_pos_) + ")");
}

std::string_view Machine::take(size_t n) {
  if (n > in_.size() - pos_) {
    fail("the file ends inside a value (" + std::to_string(n) + " bytes wanted, " +
         std::to_string(in_.size() - pos_) + " left): it is truncated or damaged");
  }
  auto s = in_.substr(pos_, n);
  pos_ += n;
  return s;
}

uint64_t Machine::uint(size_t n) {
  auto s = take(n);
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s[i])) << (8 * i);
  return v;
}

std::string Machine::line() {
  const size_t end = in_.find('\n', pos_);
  if (end == std::string_view::npos)
    fail("the file ends inside a global's name: it is truncated or damaged");
  std::string s(in_.substr(pos_, end - pos_));
  pos_ = end + 1;
  return s;
}

Mut Machine::pop() {
  if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()))
    fail("an opcode takes a value from an empty stack");
  Mut v = stack_.back();
  stack_.pop_back();
  return v;
}

Mut Machine::top() {
  if (stack_.empty()) fail("an opcode needs a value on an empty stack");
  return stack_.back();
}

std::vector<Mut> Machine::pop_mark() {
  if (marks_.empty()) fail("an opcode needs a mark and there is none");
  const size_t m = marks_.back();
  marks_.pop_back();
  std::vector<Mut> items(stack_.begin() + static_cast<long>(m), stack_.end());
  stack_.resize(m);
  return items;
}

Mut Machine::leaf(Value::Kind k) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  stack_.push_back(v);
  return v;
}

void Machine::adopt(Value& parent, const Ref& child) {
  parent.depth = std::max(parent.depth, child->depth + 1);
  if (parent.depth > o_.max_depth)
    fail("values are nested more than " + std::to_string(o_.max_depth) + " deep");
}

Mut Machine::container(Value::Kind k, std::vector<Mut> items) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  for (auto& i : items) {
    adopt(*v, i);
    v->items.push_back(std::move(i));
  }
  stack_.push_back(v);
  return v;
}

void Machine::mutate_check(const Value& v, const char* op) const {
  if (v.shared)
    fail(std::string(op) +
         " changes a value already referenced elsewhere (a "
         "recursive structure, which no checkpoint holds)");
}

void Machine::push_global(const std::string& module, const std::string& name) {
  const std::string full = module + "." + name;
  if (o_.allowed_globals.count(full) == 0) {
    fail("it names " + full + ", which a " + o_.what +
         " file never holds; refusing it (only the classes listed in docs/checkpoint.md are "
         "read, and nothing is executed)");
  }
  leaf(Value::Kind::kGlobal)->text = full;
}

void Machine::memo_put(uint64_t index) { memo_[index] = top(); }

void Machine::memo_get(uint64_t index) {
  auto it = memo_.find(index);
  if (it == memo_.end()) fail("it fetches memo entry " + std::to_string(index) + ", never stored");
  it->second->shared = true;
  stack_.push_back(it->second);
}

// Opcodes that push a plain value.
bool Machine::step_value(uint8_t op) {
  switch (op) {
    case 'N':
      leaf(Value::Kind::kNone);
      return true;
    case 0x88:
    case 0x89:
      leaf(Value::Kind::kBool)->boolean = op == 0x88;
      return true;
    case 'J':
      leaf(Value::Kind::kInt)->integer = static_cast<int32_t>(uint(4));
      return true;
    case 'K':
      leaf(Value::Kind::kInt)->integer = static_cast<int64_t>(uint(1));
      return true;
    case 'M':
      leaf(Value::Kind::kInt)->integer = static_cast<int64_t>(uint(2));
      return true;
    case 0x8a: {  // LONG1: little-endian two's complement of n bytes
      const size_t n = uint(1);
      if (n > 8) fail("an integer of " + std::to_string(n) + " bytes is past 64 bits");
      uint64_t v = n ? uint(n) : 0;
      if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign
      leaf(Value::Kind::kInt)->integer = static_cast<int64_t>(v);
      return true;
    }
    case 'G': {  // BINFLOAT: big-endian
      auto s = take(8);
      uint64_t bits = 0;
      for (char c : s) bits = bits << 8 | static_cast<uint8_t>(c);
      double d;
      std::memcpy(&d, &bits, sizeof d);
      leaf(Value::Kind::kFloat)->real = d;
      return true;
    }
    case 'X':
    case 0x8c:
    case 0x8d: {  // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
      const size_t n = uint(op == 'X' ? 4 : op == 0x8c ? 1 : 8);
      leaf(Value::Kind::kString)->text = std::string(take(n));
      return true;
    }
    case 'C':
    case 'B':
    case 0x8e: {  // SHORT_BINBYTES, BINBYTES, BINBYTES8
      const size_t n = uint(op == 'C' ? 1 : op == 'B' ? 4 : 8);
      leaf(Value::Kind::kBytes)->text = std::string(take(n));
      return true;
    }
    default:
      return false;
  }
}

// Opcodes that build, name or store values.
bool Machine::step_structure(uint8_t op) {
  switch (op) {
    case '(':
      marks_.push_back(stack_.size());
      return true;
    case '0':
      pop();
      return true;
    case '1':
      pop_mark();
      return true;
    case ')':
      container(Value::Kind::kTuple, {});
      return true;
    case 't':
      container(Value::Kind::kTuple, pop_mark());
      return true;
    case 0x85:
    case 0x86:
    case 0x87: {
      std::vector<Mut> items(static_cast<size_t>(op - 0x84));
      for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
      container(Value::Kind::kTuple, std::move(items));
      return true;
    }
    case ']':
      container(Value::Kind::kList, {});
      return true;
    case 'l':
      container(Value::Kind::kList, pop_mark());
      return true;
    case 'a':
    case 'e': {
      auto items = op == 'a' ? std::vector<Mut>{pop()} : pop_mark();
      Mut list = top();
      if (!list->is(Value::Kind::kList)) fail("APPEND into " + describe(*list));
      mutate_check(*list, "APPEND");
      for (auto& i : items) adopt(*list, i), list->items.push_back(std::move(i));
      return true;
    }
    case '}':
      container(Value::Kind::kDict, {});
      return true;
    case 'd':
    case 's':
    case 'u': {
      std::vector<Mut> items;
      if (op == 's') {
        Mut value = pop(), key = pop();
        items = {key, value};
      } else {
        items = pop_mark();
      }
      Mut dict = op == 'd' ? container(Value::Kind::kDict, {}) : top();
      if (!dict->is(Value::Kind::kDict)) fail("SETITEM into " + describe(*dict));
      if (items.size() % 2) fail("a dict's items are not key-value pairs");
      mutate_check(*dict, "SETITEM");
      for (size_t i = 0; i < items.size(); i += 2) {
        adopt(*dict, items[i]), adopt(*dict, items[i + 1]);
        dict->entries.emplace_back(items[i], items[i + 1]);
      }
      return true;
    }
    default:
      return false;
  }
}

bool Machine::step(uint8_t op) {
  if (step_value(op) || step_structure(op)) return true;
  switch (op) {
    case 'c': {
      std::string module = line();
      push_global(module, line());
      return true;
    }
    case 0x93: {
      Mut name = pop(), module = pop();
      if (!name->is(Value::Kind::kString) || !module->is(Value::Kind::kString))
        fail("STACK_GLOBAL without two strings");
      push_global(module->text, name->text);
      return true;
    }
    case 'R':
    case 0x81: {  // REDUCE, NEWOBJ: recorded, never called
      Mut args = pop(), callable = pop();
      if (!callable->is(Value::Kind::kGlobal) || !args->is(Value::Kind::kTuple))
        fail(std::string(op == 'R' ? "REDUCE" : "NEWOBJ") + " of " + describe(*callable));
      Mut obj = container(Value::Kind::kObject, {});
      obj->text = callable->text;
      for (auto& a : args->items) adopt(*obj, a), obj->items.push_back(a);
      return true;
    }
    case 'b': {
      Mut state = pop(), obj = top();
      if (!obj->is(Value::Kind::kObject) || obj->state) fail("BUILD of " + describe(*obj));
      mutate_check(*obj, "BUILD");
      adopt(*obj, state);
      obj->state = state;
      return true;
    }
    case 'Q': {
      if (!o_.persistent_ids) fail("it holds a persistent id, which a " + o_.what + " never does");
      Mut id = pop();
      container(Value::Kind::kPersistentId, {id});
      return true;
    }
    case 'q':
      memo_put(uint(1));
      return true;
    case 'r':
      memo_put(uint(4));
      return true;
    case 0x94:
      memo_put(memo_.size());
      return true;
    case 'h':
      memo_get(uint(1));
      return true;
    case 'j':
      memo_get(uint(4));
      return true;
    case 0x80:
      uint(1);
      return true;  // PROTO: every protocol's binary opcodes are read
    case 0x95:
      uint(8);
      return true;  // FRAME: a hint for buffering
    default:
      return false;
  }
}

Ref Machine::run() {
  while (pos_ < in_.size()) {
    op_pos_ = pos_;
    const uint8_t op = static_cast<uint8_t>(in_[pos_++]);
    if (op == '.') {
      if (stack_.size() != 1 || !marks_.empty())
        fail("it stops with " + std::to_string(stack_.size()) + " values on the stack");
      return stack_.back();
    }
    if (!step(op)) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", op);
      fail(std::string("opcode ") + hex + " is not one a " + o_.what +
           " file uses (a foreign or damaged pickle)");
    }
  }
  op_pos_ = pos_;
  fail("it ends without a STOP opcode: the file is truncated");
}

}  // namespace

Ref Value::get(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k->is(Kind::kString) && k->text == key) return v;
  }
  return nullptr;
}

Ref read(std::string_view bytes, const ReadOptions& options) {
  return Machine(bytes, options).run();
}

std::string describe(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.boolean ? "True" : "False";
    case Value::Kind::kInt:
      return "the integer " + std::to_string(v.integer);
    case Value::Kind::kFloat:
      return "a float";
    case Value::Kind::kString:
      return "the string '" + v.text.substr(0, 60) + "'";
    case Value::Kind::kBytes:
      return "bytes";
    case Value::Kind::kTuple:
      return "a tuple of " + std::to_string(v.items.size());
    case Value::Kind::kList:
      return "a list of " + std::to_string(v.items.size());
    case Value::Kind::kDict:
      return "a dict of " + std::to_string(v.entries.size());
    case Value::Kind::kGlobal:
      return v.text;
    case Value::Kind::kObject:
      return "a " + v.text;
    case Value::Kind::kPersistentId:
      return "a persistent id";
  }
  return "a value";
}

}  // namespace scaletrain::pickle
