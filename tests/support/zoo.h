#pragma once
// A zoo model (models.h) as the exact reference of support/tolerance.h wants it: a factory of
// fresh modules and a forward that works on any module the factory made.

#include <map>
#include <memory>
#include <string>

#include "support/tolerance.h"
#include "zoo_models.h"

namespace scaletrain::testing {

struct ZooReference {
  MakeModule make;
  Forward forward;
};

/// `eval`: the modules are made in eval mode (batch norm uses its running statistics).
inline ZooReference zoo_reference(const std::string& name, const ModelOptions& options = {},
                                  bool eval = false) {
  // The zoo's forward belongs to the Model that made the module: keep them together.
  auto made = std::make_shared<std::map<const torch::nn::Module*, Model>>();
  ZooReference r;
  r.make = [made, name, options, eval] {
    Model fresh = make_model(name, options);
    if (eval) fresh.module->eval();
    (*made)[fresh.module.get()] = fresh;
    return fresh.module;
  };
  r.forward = [made](torch::nn::Module& module, const at::Tensor& in) {
    return made->at(&module).forward(in);
  };
  return r;
}

}  // namespace scaletrain::testing
