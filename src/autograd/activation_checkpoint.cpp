// Note [Recompute in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Forward runs fn under no-grad: nothing but the input (detached) and the generators' states is
// kept. Backward puts the states back, runs fn again with grad on a fresh leaf made from the
// input, and back-propagates the incoming gradient through that new graph (a backward inside
// the backward, as PyTorch's reentrant checkpoint does): the parameters' gradients accumulate
// on the way, and the leaf's gradient is what the Function returns for its input. The
// generators are left as they were before the recomputation, so the draws after it are those
// of a run without checkpointing.

#include "scaletrain/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>

namespace scaletrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Fn = std::function<at::Tensor(const at::Tensor&)>;

// The function and the generator states, carried through the autograd context.
struct Held : torch::CustomClassHolder {
  Fn fn;
  at::Tensor cpu_state, device_state;
  std::optional<at::Device> device;
};

// A handle on the default generator of `d` (the CPU's, or a GPU's), and its state swapped.
at::Generator generator_of(const at::Device& d) {
  return d.is_cpu() ? at::detail::getDefaultCPUGenerator()
                    : at::globalContext().defaultGenerator(d);
}
at::Tensor state_of(const at::Device& d) {
  at::Generator g = generator_of(d);
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
void set_state(const at::Device& d, const at::Tensor& state) {
  at::Generator g = generator_of(d);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// Sets the generators to `held`'s states for the life of this object, then back.
class GeneratorsAt {
 public:
  explicit GeneratorsAt(const Held& held) : held_(held), cpu_(state_of(at::kCPU)) {
    set_state(at::kCPU, held.cpu_state);
    if (held.device) {
      device_ = state_of(*held.device);
      set_state(*held.device, held.device_state);
    }
  }
  ~GeneratorsAt() {
    set_state(at::kCPU, cpu_);
    if (held_.device) set_state(*held_.device, device_);
  }
  GeneratorsAt(const GeneratorsAt&) = delete;
  GeneratorsAt& operator=(const GeneratorsAt&) = delete;

 private:
  const Held& held_;
  at::Tensor cpu_, device_;
};

struct Recompute : torch::autograd::Function<Recompute> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue held) {
    ctx->saved_data["held"] = held;
    ctx->save_for_backward({x});
    at::NoGradGuard no_grad;
    return static_cast<Held*>(held.toCapsule().get())->fn(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto& held = *static_cast<Held*>(ctx->saved_data.at("held").toCapsule().get());
    const at::Tensor saved = ctx->get_saved_variables()[0];
    at::Tensor leaf = saved.detach().requires_grad_(saved.is_floating_point());
    at::Tensor y;
    {
      GeneratorsAt replay(held);
      at::AutoGradMode grad(true);
      y = held.fn(leaf);
    }
    if (y.requires_grad()) torch::autograd::backward({y}, {g[0]});
    return {leaf.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor activation_checkpoint(Fn fn, const at::Tensor& input) {
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return fn(input);
  auto held = c10::make_intrusive<Held>();
  held->fn = std::move(fn);
  held->cpu_state = state_of(at::kCPU);
  if (!input.device().is_cpu()) {
    held->device = input.device();
    held->device_state = state_of(input.device());
  }
  return Recompute::apply(input, c10::IValue::make_capsule(std::move(held)));
}

}  // namespace scaletrain
