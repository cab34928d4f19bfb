// Models defined in Python (python_model.h).
//
// Note [A TorchScript module as an nn::Module]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The trainer and every wrapper take a torch::nn::Module: its parameters() and buffers(), their
// names, to(device), train(on). ScriptModuleImpl mirrors the TorchScript module's tree in plain
// modules (one per submodule, under the submodule's name) and registers in each the very tensors
// the script module holds, so named_parameters() gives Python's names, and an optimizer step, a
// move to a device (set_data keeps the TensorImpl), ZeRO's aliases into its flat buffers and a
// checkpoint's load all act on the tensors the script's forward reads. forward() runs the
// script's own; train(on) sets the script's `training` flags too. An nn.Sequential's blocks are
// such modules over its children (the same tensors again), which pipelines and fsdp's units cut
// along; another module is one block.

#include "scaletrain/python_model.h"

#include <torch/script.h>

#include <filesystem>
#include <fstream>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

class MirrorImpl : public torch::nn::Module {};  // a submodule's place in the tree of names

void mirror(const torch::jit::Module& from, torch::nn::Module& to) {
  for (const auto& p : from.named_parameters(/*recurse=*/false)) {
    to.register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : from.named_buffers(/*recurse=*/false)) to.register_buffer(b.name, b.value);
  for (const auto& c : from.named_children()) {
    auto child = std::make_shared<MirrorImpl>();
    mirror(c.value, *child);
    to.register_module(c.name, child);
  }
}

class ScriptModuleImpl : public torch::nn::Module {
 public:
  ScriptModuleImpl(torch::jit::Module module, std::string name)
      : module_(std::move(module)), name_(std::move(name)) {
    mirror(module_, *this);
  }

  at::Tensor forward(const at::Tensor& x) {
    c10::IValue out = module_.forward({x});
    if (!out.isTensor()) {
      throw UsageError("model '" + name_ + "': forward returned a " + out.tagKind() +
                       ", and the trainer's loss reads one tensor; return the outputs alone");
    }
    return out.toTensor();
  }

  void train(bool on) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }

  const torch::jit::Module& script() const { return module_; }

 private:
  torch::jit::Module module_;
  std::string name_;
};

bool is_sequential(const torch::jit::Module& m) {
  const auto type = m.type()->name();
  return type &&
         type->qualifiedName().find("torch.nn.modules.container.Sequential") != std::string::npos;
}

void check_forward(const torch::jit::Module& m, const std::string& name) {
  auto method = m.find_method("forward");
  if (!method) throw UsageError("model '" + name + "' has no forward method");
  const auto& args = method->function().getSchema().arguments();  // self, then the inputs
  if (args.size() != 2) {
    throw UsageError("model '" + name + "': forward takes " + std::to_string(args.size() - 1) +
                     " inputs, and the trainer gives one tensor (the batch); wrap the module in "
                     "one whose forward(x) calls it");
  }
  bool trainable = false;
  for (const auto& p : m.parameters()) trainable = trainable || p.requires_grad();
  if (!trainable) {
    throw UsageError("model '" + name +
                     "' has no trainable parameter (none, or all with requires_grad False): "
                     "there is nothing to train");
  }
}

}  // namespace

Model script_model(const torch::jit::Module& module, const std::string& name) {
  check_forward(module, name);
  auto m = std::make_shared<ScriptModuleImpl>(module, name);
  Model model{name, m, [m](const at::Tensor& x) { return m->forward(x); }, nullptr};
  if (is_sequential(module)) {
    model.blocks = [m, name] {
      torch::nn::Sequential chain;
      for (const auto& c : m->script().named_children()) {
        chain->push_back(c.name, std::make_shared<ScriptModuleImpl>(c.value, name + "." + c.name));
      }
      return chain;
    };
  } else {
    model.blocks = [m] { return torch::nn::Sequential(m); };
  }
  return model;
}

bool is_python_model_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

Model load_python_model(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw UsageError("Python model " + path + ": no such file");
  }
  if (!is_python_model_file(path)) {
    throw UsageError("Python model " + path +
                     ": not a TorchScript archive (a zip); save the module from Python with "
                     "torch.jit.save(torch.jit.script(module), path)");
  }
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, at::Device(at::kCPU));
  } catch (const c10::Error& e) {
    throw UsageError("Python model " + path +
                     " is a zip but not a TorchScript module that LibTorch reads (" +
                     e.what_without_backtrace() +
                     "); save it with torch.jit.save(torch.jit.script(module), path)");
  }
  return script_model(module, std::filesystem::path(path).stem().string());
}

}  // namespace scaletrain
