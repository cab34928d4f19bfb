// The pickle writer (pickle.h): protocol 2's binary opcodes, as torch.save writes them.

#include "checkpoint/pickle.h"

#include <cstring>

namespace scaletrain::pickle {

Writer::Writer() {
  put(0x80);  // PROTO 2: what torch.save writes, and every Python 3 reads
  put(2);
}

void Writer::put(uint8_t op) { out_.push_back(static_cast<char>(op)); }

void Writer::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) put(static_cast<uint8_t>(v >> (8 * i)));
}

void Writer::none() { put('N'); }
void Writer::boolean(bool b) { put(b ? 0x88 : 0x89); }

void Writer::integer(int64_t i) {
  if (i >= 0 && i < 256) {
    put('K');
    put(static_cast<uint8_t>(i));
  } else if (i >= 0 && i < 65536) {
    put('M');
    put(static_cast<uint8_t>(i));
    put(static_cast<uint8_t>(i >> 8));
  } else if (i >= INT32_MIN && i <= INT32_MAX) {
    put('J');
    u32(static_cast<uint32_t>(i));
  } else {
    put(0x8a);  // LONG1 of 8 bytes, two's complement
    put(8);
    for (int b = 0; b < 8; ++b) put(static_cast<uint8_t>(static_cast<uint64_t>(i) >> (8 * b)));
  }
}

void Writer::real(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  put('G');
  for (int b = 7; b >= 0; --b) put(static_cast<uint8_t>(bits >> (8 * b)));
}

void Writer::string(const std::string& s) {
  put('X');
  u32(static_cast<uint32_t>(s.size()));
  out_ += s;
}

void Writer::global(const std::string& module, const std::string& name) {
  const std::string key = module + "\n" + name + "\n";
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    if (it->second < 256) {
      put('h');
      put(static_cast<uint8_t>(it->second));
    } else {
      put('j');
      u32(it->second);
    }
    return;
  }
  put('c');
  out_ += key;
  const auto index = static_cast<uint32_t>(memo_.size());
  memo_[key] = index;
  put('r');  // LONG_BINPUT
  u32(index);
}

void Writer::mark() { put('('); }

void Writer::tuple(int n) {
  if (n < 0) return put('t');
  if (n == 0) return put(')');
  put(static_cast<uint8_t>(0x84 + n));  // TUPLE1, TUPLE2, TUPLE3
}

void Writer::empty_dict() { put('}'); }
void Writer::setitems() { put('u'); }
void Writer::empty_list() { put(']'); }
void Writer::appends() { put('e'); }
void Writer::reduce() { put('R'); }
void Writer::newobj() { put(0x81); }
void Writer::build() { put('b'); }
void Writer::persistent_id() { put('Q'); }

std::string Writer::finish() {
  put('.');
  return std::move(out_);
}

}  // namespace scaletrain::pickle
