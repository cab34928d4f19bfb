// The keys PyTorch's DCP uses for a model and an optimizer (distributed_checkpoint.h), and the
// values that are not tensors.

#include "scaletrain/distributed_checkpoint.h"

namespace scaletrain {

DcpKey dcp_model_key(const std::string& fqn) { return {"model." + fqn, {"model", fqn}}; }

DcpKey dcp_optimizer_key(const std::string& fqn, const std::string& kind) {
  // get_state_dict()'s optimizer state: {"state": {fqn: {kind: tensor}}, "param_groups": [...]},
  // saved under "optim" as torchtitan and the DCP tutorials do.
  return {"optim.state." + fqn + "." + kind, {"optim", "state", fqn, kind}};
}

DcpKey dcp_param_group_key(int group, const std::string& field) {
  const std::string g = std::to_string(group);
  return {"optim.param_groups." + g + "." + field, {"optim", "param_groups", g, field}};
}

DcpValue DcpValue::of(bool b) {
  DcpValue v;
  v.kind = Kind::kBool;
  v.boolean = b;
  return v;
}

DcpValue DcpValue::of(int64_t i) {
  DcpValue v;
  v.kind = Kind::kInt;
  v.integer = i;
  return v;
}

DcpValue DcpValue::of(double d) {
  DcpValue v;
  v.kind = Kind::kFloat;
  v.real = d;
  return v;
}

DcpValue DcpValue::of(std::string s) {
  DcpValue v;
  v.kind = Kind::kString;
  v.text = std::move(s);
  return v;
}

DcpValue DcpValue::list(std::vector<DcpValue> items) {
  DcpValue v;
  v.kind = Kind::kList;
  v.items = std::move(items);
  return v;
}

DcpValue DcpValue::tuple(std::vector<DcpValue> items) {
  DcpValue v = list(std::move(items));
  v.kind = Kind::kTuple;
  return v;
}

bool DcpValue::operator==(const DcpValue& o) const {
  return kind == o.kind && boolean == o.boolean && integer == o.integer &&
         (real == o.real || (real != real && o.real != o.real)) && text == o.text &&
         items == o.items;
}

}  // namespace scaletrain
