#pragma once
// PyTorch's distributed checkpoint (DCP) format: a folder that Python's
// torch.distributed.checkpoint reads and writes (Note [DCP layout] in
// src/checkpoint/dcp_metadata.cpp; docs/checkpoint.md, "PyTorch's distributed checkpoint").
//
//   DIR/.metadata          every key's dtype, global shape and saved chunks (rank 0 writes it)
//   DIR/__<rank>_0.distcp  each rank's boxes, one torch.save'd tensor after another
//
// Each rank saves the boxes of the tensors it holds (box.h: the global shape and where its part
// lies), and any box of any tensor can be read back at any other layout: a tensor split by rows
// over 4 ranks loads by columns over 3, or whole. Python's dcp.load reads such a folder into a
// plain model's state_dict() (or an FSDP2 / DTensor one), and dcp_to_torch_save converts it.
//
//   // every rank: its rows of "model.w" (global 10 x 4) and, on rank 0, the bias whole
//   std::vector<scaletrain::TensorBox> mine = {{dcp_model_key("w"), rows, {10, 4}, {first, 0}}};
//   if (dist.rank() == 0) mine.push_back({dcp_model_key("b"), bias, {4}, {0}});
//   scaletrain::save_distributed_checkpoint("ckpt/step-100", {mine}, dist);
//   ...
//   std::vector<scaletrain::TensorBox> want = {{dcp_model_key("w"), at::empty({10, 2}), {10, 4},
//                                               {0, 2}}};       // columns 2-3, any rank
//   scaletrain::load_distributed_checkpoint("ckpt/step-100", want);
//
// Keys. DCP flattens a nested state dict with '.': dcp.save({"model": model.state_dict()})
// holds "model.<parameter>"; the optimizer of get_state_dict() holds
// "optim.state.<parameter>.<kind>" and "optim.param_groups.<i>.<field>". A key's `path` is the
// nesting it came from (planner_data), which dcp_to_torch_save restores; the helpers below give
// both for the names this library uses.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "scaletrain/box.h"
#include "scaletrain/dist.h"

namespace scaletrain {

/// A key of the checkpoint: the flattened `name` Python's DCP sees, and the `path` of nested
/// keys of the state dict it stands for ({"model", "fc.weight"}); empty: `name` at the top. A
/// part made only of digits is a list index (param_groups' "0").
struct DcpKey {
  std::string name;
  std::vector<std::string> path;
};

/// dcp.save({"model": model.state_dict()})'s key of a parameter or buffer.
DcpKey dcp_model_key(const std::string& fqn);
/// get_state_dict()'s key of an optimizer's state: kind "exp_avg", "exp_avg_sq", "step"
/// (Adam, AdamW), "momentum_buffer" (SGD), under "optim.state.<fqn>.<kind>".
DcpKey dcp_optimizer_key(const std::string& fqn, const std::string& kind);
/// get_state_dict()'s key of a hyperparameter of param group `group` ("lr", "betas"...).
DcpKey dcp_param_group_key(int group, const std::string& field);

/// The box of a tensor this rank saves or wants: `tensor` holds its values (its sizes are the
/// box's), at `offsets` (empty: all zero) in the tensor of `global_shape`.
struct TensorBox {
  DcpKey key;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
};

/// A value that is not a tensor (BytesStorageMetadata: Python sees the object torch.save'd):
/// None, a bool, an int, a float, a string, or a list or tuple of values.
struct DcpValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kList, kTuple };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;
  std::vector<DcpValue> items;

  static DcpValue of(bool b);
  static DcpValue of(int64_t i);
  static DcpValue of(double d);
  static DcpValue of(std::string s);
  static DcpValue list(std::vector<DcpValue> items);
  static DcpValue tuple(std::vector<DcpValue> items);
  bool operator==(const DcpValue& o) const;
};

/// What one rank saves: its boxes, and (rank 0's only are written) named values.
struct DcpState {
  std::vector<TensorBox> tensors;
  std::vector<std::pair<DcpKey, DcpValue>> values;
};

struct DcpSaveOptions {
  /// A folder already at the path: refused (Error) unless true, then replaced atomically.
  bool replace = false;
  /// Called on rank 0 with the temporary folder once every rank's file and the .metadata are
  /// in it, before it is synced and renamed to its name: to add files of one's own (a record of
  /// checksums), or for tests of a crash at that moment. What it throws fails the save, on every
  /// rank, as a rank's failed write does.
  std::function<void(const std::string& folder)> before_publish;
};

/// Collective over `dist` (every rank calls it, in the same order as other collectives): writes
/// each rank's boxes to `dir/__<rank>_0.distcp` and rank 0 the `.metadata` of all of them. The
/// ranks' lists travel through `dist`'s store. A box that several ranks hold (a replicated
/// tensor) is written once, by the lowest rank. Atomic: the files go to a temporary folder that
/// is renamed to `dir` once complete and synced, so `dir` is complete or absent; when it
/// returns, on every rank, it is complete. Tensors may live on any device (copied to the CPU).
/// `dist` need not be joined for a single process.
/// Throws UsageError, on every rank, when the boxes do not tile a tensor exactly (an element of
/// no rank or of two, naming the tensor and the element), ranks give a tensor other shapes or
/// dtypes, a box does not fit its global shape or the dtype is not one of float64, float32,
/// float16, bfloat16, int64, int32, int16, int8, uint8, bool; Error when a rank cannot write
/// (naming the rank and the file) or `dir` exists without `replace`.
void save_distributed_checkpoint(const std::string& dir, const DcpState& state, const Dist& dist,
                                 const DcpSaveOptions& options = {});

/// What a folder holds, from its .metadata alone.
struct DcpTensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<Box> chunks;
};
struct DcpContents {
  std::map<std::string, DcpTensorInfo> tensors;
  std::vector<std::string> values;
};
/// Reads `dir/.metadata` with a reader that executes nothing and knows only the classes a DCP
/// metadata holds (docs/checkpoint.md lists them). Throws Error naming the file for a missing,
/// damaged or foreign one.
DcpContents read_distributed_checkpoint_contents(const std::string& dir);

/// Not collective: fills each box's `tensor` (allocated by the caller, any device and dtype:
/// values are converted as copy_ does) with that box of the saved tensor `key.name`, whatever
/// layout saved it. Throws Error naming the file for a damaged folder (metadata, a truncated or
/// foreign item), and naming the keys for a key that is missing or saved with another global
/// shape; UsageError for a box that does not fit its global shape. On an error the tensors may
/// be partly filled.
void load_distributed_checkpoint(const std::string& dir, std::vector<TensorBox>& boxes);

/// Every tensor of the folder whole, on the CPU in its saved dtype, by key (`prefix` + ...: only
/// the keys that start with it, the prefix taken off). Same errors as above.
std::map<std::string, at::Tensor> load_distributed_checkpoint_tensors(
    const std::string& dir, const std::string& prefix = "");

/// The values of the folder (BytesStorageMetadata) that hold None, bools, ints, floats, strings
/// and lists or tuples of them, by key; Error naming the key for any other object.
std::map<std::string, DcpValue> load_distributed_checkpoint_values(const std::string& dir);

/// A whole model and its optimizer as Python's get_state_dict(model, optim) names them, ready to
/// save as dcp.save({"model": ..., "optim": ...}) would: every parameter and buffer as
/// "model.<fqn>"; for torch::optim::SGD, Adam and AdamW each parameter's state as
/// "optim.state.<fqn>.<kind>" (Adam's step as a float32 0-d tensor, as Python keeps it; zeros
/// and step 0 for a parameter with no state yet) and each group's hyperparameters as
/// "optim.param_groups.<i>.<field>", with every field Python 2.11's optimizer has (those LibTorch
/// lacks at Python's defaults) and "params", the group's parameter names. Every box is the whole
/// tensor, views of the model's own: call it on every rank of a replicated model (the save
/// writes each once) and save before the next step changes them. Throws UsageError for another
/// optimizer or one with parameters not in `model`.
DcpState dcp_module_state(const torch::nn::Module& model, const torch::optim::Optimizer* opt);

/// Loads a folder with dcp_module_state()'s keys (scaletrain's, or Python's dcp.save of
/// get_state_dict()) into `model` (in place, converting devices and dtypes) and, when given,
/// the state of `opt` (SGD, Adam, AdamW; its hyperparameters stay its own). Not collective.
/// Throws Error naming the missing keys and other shapes before anything is changed, and the
/// errors of load_distributed_checkpoint().
void load_dcp_module_state(const std::string& dir, torch::nn::Module& model,
                           torch::optim::Optimizer* opt);

}  // namespace scaletrain
