#pragma once
// The items of a DCP .distcp file (internal; Note [DCP items] in dcp_payload.cpp): each is a
// whole torch.save archive (a zip) of one tensor chunk or one value, as 2.11's FileSystemWriter
// writes them with its default SerializationFormat.TORCH_SAVE.

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "scaletrain/distributed_checkpoint.h"

namespace scaletrain::dcp {

/// torch.<name>'s dtype ("float32" -> kFloat); Error naming `where` for another name.
at::ScalarType scalar_type(const std::string& name, const std::string& where);
/// The name of a dtype in known_dtypes(); UsageError naming `where` for another dtype.
std::string dtype_name(at::ScalarType t, const std::string& where);

/// torch.save(t): `t` must be a contiguous CPU tensor; its bytes are written as they are.
std::string tensor_item(const at::Tensor& t);
/// torch.save(v).
std::string value_item(const DcpValue& v);

/// torch.load of a tensor item, with a reader that executes nothing: a tensor of the item's
/// dtype and shape on the CPU. Throws Error naming `where` (the file and the byte range) for a
/// damaged archive, a class other than a tensor's, a storage shorter than the tensor.
at::Tensor read_tensor_item(std::string_view bytes, const std::string& where);
/// The same for a value item (DcpValue's kinds only; Error naming `where` for other objects).
DcpValue read_value_item(std::string_view bytes, const std::string& where);

}  // namespace scaletrain::dcp
