#pragma once
// The zoo's transformers with mixture-of-experts layers (internal): which MLPs are MoE layers
// (expert_parallel.h), and their options.

#include <cstdint>

#include "scaletrain/expert_parallel.h"

namespace scaletrain {

struct ZooMoE {
  int64_t experts = 0;  // 0: every MLP dense
  int64_t top_k = 2;    // experts per token
  int64_t every = 1;    // the MLP of every n-th layer is a MoE (layers n − 1, 2n − 1, …)
  double aux_loss_coef = 0.01;  // the load-balancing loss's coefficient

  bool at(int64_t layer) const { return experts > 0 && every > 0 && (layer + 1) % every == 0; }
  /// A MoE layer of `dim` wide tokens, each expert an MLP `hidden` wide (GELU, or SwiGLU).
  MoEOptions options(int64_t dim, int64_t hidden, bool swiglu) const {
    MoEOptions o(dim, hidden, experts);
    o.top_k = top_k;
    o.aux_loss_coef = aux_loss_coef;
    o.swiglu = swiglu;
    return o;
  }
  /// The parameters a token meets in one MoE layer, for the model-FLOPs estimate: the router and
  /// its k experts (each `per_expert`).
  int64_t active_parameters(int64_t dim, int64_t per_expert) const {
    return dim * experts + top_k * per_expert;
  }
};

}  // namespace scaletrain
