// An input for check-structure.py's zoo check: line 4 includes a zoo header and line 8 calls the
// zoo; the comment on line 9 and the string on line 10 do not count.
#include <string>
#include "zoo_models.h"

namespace scaletrain {
void build() {
  auto model = make_model("lenet");
  // make_model() in a comment
  std::string s = "make_model";
}
}  // namespace scaletrain
