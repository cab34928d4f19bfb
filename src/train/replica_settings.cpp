#include "train/replica_settings.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <sstream>
#include <typeinfo>

namespace scaletrain {

// Note [Replica settings]: replicas train one model together, each on its share of every batch,
// and sum their gradients; a replica whose learning rate, optimizer or model differs would
// silently train something else beside the job (and an optimizer of another kind died later in
// LibTorch's internals). The lighthouse compares what each replica asks with (ReplicaGroup's
// fingerprint) and refuses a difference, naming it (regressions
// FaultTolerantReplicas.AReplicaWithAnotherLearningRateIsRefusedByName and ...AnotherOptimizer).
// The optimizer is read from the optimizer itself, so a program's own factory is covered too;
// the model by its printed structure, which names every module's options (Dropout's p
// included). A program adds settings of its own through ReplicaGroupOptions::fingerprint.

namespace {

// The shortest text that reads back as `v` (0.05, not 0.050000000000000003).
std::string number(double v) {
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream s;
    s.precision(digits);
    s << v;
    text = s.str();
    if (std::stod(text) == v) break;
  }
  return text;
}

std::string optimizer_options(const torch::optim::OptimizerOptions& g) {
  using namespace torch::optim;
  std::ostringstream s;
  if (const auto* o = dynamic_cast<const SGDOptions*>(&g)) {
    s << "sgd(lr=" << number(o->lr()) << ",momentum=" << number(o->momentum())
      << ",dampening=" << number(o->dampening()) << ",weight_decay=" << number(o->weight_decay())
      << ",nesterov=" << o->nesterov() << ")";
  } else if (const auto* a = dynamic_cast<const AdamOptions*>(&g)) {
    s << "adam(lr=" << number(a->lr()) << ",betas=" << number(std::get<0>(a->betas())) << "/"
      << number(std::get<1>(a->betas())) << ",eps=" << number(a->eps())
      << ",weight_decay=" << number(a->weight_decay()) << ",amsgrad=" << a->amsgrad() << ")";
  } else if (const auto* w = dynamic_cast<const AdamWOptions*>(&g)) {
    s << "adamw(lr=" << number(w->lr()) << ",betas=" << number(std::get<0>(w->betas())) << "/"
      << number(std::get<1>(w->betas())) << ",eps=" << number(w->eps())
      << ",weight_decay=" << number(w->weight_decay()) << ",amsgrad=" << w->amsgrad() << ")";
  } else if (const auto* r = dynamic_cast<const RMSpropOptions*>(&g)) {
    s << "rmsprop(lr=" << number(r->lr()) << ",alpha=" << number(r->alpha())
      << ",eps=" << number(r->eps()) << ",weight_decay=" << number(r->weight_decay())
      << ",momentum=" << number(r->momentum()) << ",centered=" << r->centered() << ")";
  } else if (const auto* d = dynamic_cast<const AdagradOptions*>(&g)) {
    s << "adagrad(lr=" << number(d->lr()) << ",lr_decay=" << number(d->lr_decay())
      << ",weight_decay=" << number(d->weight_decay()) << ",eps=" << number(d->eps()) << ")";
  } else {
    s << typeid(g).name() << "(lr=" << number(g.get_lr()) << ")";
  }
  return s.str();
}

// FNV-1a, 64 bits: the same on every machine and build, unlike std::hash.
std::string digest(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  std::ostringstream s;
  s << std::hex << h;
  return s.str();
}

}  // namespace

std::string replica_settings(const TrainerOptions& o, const std::string& model_name,
                             const torch::nn::Module& module,
                             const torch::optim::Optimizer& optimizer, int64_t samples) {
  std::ostringstream s;
  s << "seed=" << o.seed << "|batch=" << o.batch_size << "|samples=" << samples
    << "|epochs=" << o.epochs << "|model=" << model_name;
  std::ostringstream structure;
  structure << module;
  s << "|structure=" << digest(structure.str());
  const auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    s << "|optimizer" << (groups.size() > 1 ? std::to_string(i) : "") << "="
      << optimizer_options(groups[i].options());
  }
  s << "|strategy=" << to_string(o.strategy) << "|tp=" << o.tensor_parallel.size
    << "|sequence_parallel=" << o.tensor_parallel.sequence_parallel
    << "|accumulate=" << o.accumulate << "|max_grad_norm=" << number(o.max_grad_norm)
    << "|amp=" << to_string(o.amp);
  return s.str();
}

}  // namespace scaletrain
