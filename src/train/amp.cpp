#include "scaletrain/amp.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <vector>

#include "scaletrain/dist.h"
#include "scaletrain/error.h"

namespace scaletrain {

Autocast::Autocast(c10::DeviceType device, c10::ScalarType dtype)
    : device_(device),
      was_enabled_(at::autocast::is_autocast_enabled(device)),
      old_dtype_(at::autocast::get_autocast_dtype(device)) {
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    throw UsageError(std::string("autocast runs in float16 or bfloat16, not ") +
                     c10::toString(dtype));
  }
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // Casts are cached while autocast is on; the outermost scope drops them.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, old_dtype_);
}

GradScaler::GradScaler(GradScalerOptions o) : o_(o) {
  if (o_.init_scale <= 0 || o_.growth_factor <= 1 || o_.backoff_factor <= 0 ||
      o_.backoff_factor >= 1 || o_.growth_interval < 1) {
    throw UsageError(
        "GradScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
        "growth_interval >= 1");
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!o_.enabled) return loss;
  if (!scale_.defined() || scale_.device() != loss.device()) {
    const double s = scale_.defined() ? scale_.item<double>() : o_.init_scale;
    const auto opts = at::TensorOptions().device(loss.device());
    scale_ = at::full({1}, s, opts.dtype(at::kFloat));
    growth_tracker_ = growth_tracker_.defined() ? growth_tracker_.to(loss.device())
                                                : at::zeros({1}, opts.dtype(at::kInt));
    found_inf_ = at::zeros({1}, opts.dtype(at::kFloat));
  }
  return loss * scale_.to(loss.scalar_type());
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!o_.enabled) {
    optimizer.step();
    return true;
  }
  if (!scale_.defined()) throw Error("GradScaler::step() before any scale(): nothing to unscale");
  found_inf_.zero_();
  // The kernel takes the gradients of one device and dtype at a time.
  struct Group {
    c10::Device device;
    c10::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> groups;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
        return x.device == g.device() && x.dtype == g.scalar_type();
      });
      if (it == groups.end()) it = groups.insert(groups.end(), {g.device(), g.scalar_type(), {}});
      it->grads.push_back(g);
    }
  }
  const at::Tensor inv = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  for (auto& g : groups) {
    auto found = at::zeros({1}, found_inf_.options().device(g.device));
    at::_amp_foreach_non_finite_check_and_unscale_(g.grads, found, inv.to(g.device));
    found_inf_.add_(found.to(found_inf_.device()));
  }
  if (o_.agree_over != nullptr && o_.agree_over->size() > 1) {
    o_.agree_over->all_reduce(found_inf_);  // any rank's inf or NaN skips every rank's step
  }
  const bool finite = found_inf_.item<float>() == 0;
  if (finite) optimizer.step();
  return finite;
}

void GradScaler::update() {
  if (!o_.enabled || !scale_.defined()) return;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, o_.growth_factor, o_.backoff_factor,
                         o_.growth_interval);
  found_inf_.zero_();
}

std::map<std::string, at::Tensor> GradScaler::state() const {
  if (!scale_.defined()) return {};
  return {{"scale", scale_.cpu().clone()}, {"growth_tracker", growth_tracker_.cpu().clone()}};
}

void GradScaler::load_state(const std::map<std::string, at::Tensor>& state) {
  if (state.empty()) return;
  const auto scale = state.find("scale"), tracker = state.find("growth_tracker");
  if (scale == state.end() || tracker == state.end()) {
    throw UsageError("GradScaler::load_state: the state needs 'scale' and 'growth_tracker'");
  }
  const auto device = scale_.defined() ? scale_.device() : scale->second.device();
  scale_ = scale->second.to(device, at::kFloat).reshape({1}).clone();
  growth_tracker_ = tracker->second.to(device, at::kInt).reshape({1}).clone();
  found_inf_ = at::zeros({1}, scale_.options());
}

double GradScaler::current_scale() const {
  if (!o_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : o_.init_scale;
}

}  // namespace scaletrain
