#include "support/tolerance.h"

#include <ATen/ops/abs.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/softmax.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace scaletrain::testing {

double unit_roundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return std::ldexp(1.0, -53);
    case at::kFloat:
      return std::ldexp(1.0, -24);
    case at::kHalf:
      return std::ldexp(1.0, -11);
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    default:
      throw std::invalid_argument("unit_roundoff: not a floating type");
  }
}

namespace {

// The smallest normal number: below it a rounding error is absolute, not relative.
double smallest_normal(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return std::numeric_limits<double>::min();
    case at::kFloat:
      return static_cast<double>(std::numeric_limits<float>::min());
    case at::kHalf:
      return std::ldexp(1.0, -14);
    default:
      return static_cast<double>(std::numeric_limits<float>::min());  // bfloat16: float's range
  }
}

}  // namespace

double gamma(double terms, at::ScalarType dtype) { return gamma_of(terms, unit_roundoff(dtype)); }

::testing::AssertionResult within_rounding(const at::Tensor& got, const at::Tensor& exact,
                                           const at::Tensor& magnitude, double terms,
                                           at::ScalarType dtype, double absolute) {
  if (!got.defined() || !exact.defined()) {
    return ::testing::AssertionFailure()
           << "undefined tensor (got " << got.defined() << ", exact " << exact.defined() << ")";
  }
  auto g = got.detach().to(at::kCPU, at::kDouble).contiguous();
  auto x = exact.detach().to(at::kCPU, at::kDouble).expand_as(g).contiguous();
  if (g.sizes() != exact.sizes() && exact.numel() != 1) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " against " << exact.sizes();
  }
  auto bound = (magnitude.detach().to(at::kCPU, at::kDouble).abs() * gamma(terms, dtype) +
                terms * smallest_normal(dtype) + absolute)
                   .expand_as(g)
                   .contiguous();
  auto diff = (g - x).abs();
  auto excess = (diff - bound).reshape({-1});
  if (g.numel() == 0) return ::testing::AssertionSuccess();
  const double worst_excess = excess.max().item<double>();
  if (worst_excess <= 0) return ::testing::AssertionSuccess();  // false for NaN, too
  const int64_t i = std::isnan(worst_excess)
                        ? at::isnan(excess).to(at::kLong).argmax().item<int64_t>()
                        : excess.argmax().item<int64_t>();
  const double b = bound.reshape({-1})[i].item<double>();
  std::ostringstream s;
  s.precision(9);
  s << "element " << i << " of " << g.numel() << ": got " << g.reshape({-1})[i].item<double>()
    << ", exact " << x.reshape({-1})[i].item<double>() << ", |diff| "
    << diff.reshape({-1})[i].item<double>() << " > bound " << b << " = gamma(" << terms << ", "
    << c10::toString(dtype) << ") x magnitude " << (b - absolute) / gamma(terms, dtype) << " + "
    << absolute << " (Note [Tolerances]); max |diff| " << diff.max().item<double>();
  return ::testing::AssertionFailure() << s.str();
}

::testing::AssertionResult bit_for_bit(const at::Tensor& got, const at::Tensor& want) {
  if (at::equal(got, want)) return ::testing::AssertionSuccess();
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << "shape " << got.sizes() << " against " << want.sizes();
  }
  const auto g = got.detach().to(at::kDouble), w = want.detach().to(at::kDouble);
  return ::testing::AssertionFailure()
         << "largest difference " << (g - w).abs().max().item<double>() << " in values up to "
         << w.abs().max().item<double>();
}

::testing::AssertionResult within_rounding(const at::Tensor& got, double exact, double magnitude,
                                           double terms, at::ScalarType dtype) {
  return within_rounding(got, at::scalar_tensor(exact, at::kDouble),
                         at::scalar_tensor(magnitude, at::kDouble), terms, dtype);
}

LossGradientFn mse_gradient(const at::Tensor& target, double scale) {
  auto y = target.detach().to(at::kDouble);
  return [y, scale](const at::Tensor& out, const at::Tensor& out_magnitude) {
    const double k = 2 * scale / static_cast<double>(out.numel());
    auto diff = out - y;
    // float: (o + e_o − y)·k, with |e_o| ≤ gamma·M_o and a rounding or two relative to |o − y|.
    return LossGradient{diff * k, (out_magnitude + diff.abs()) * k};
  };
}

LossGradientFn cross_entropy_gradient(const at::Tensor& target, double scale) {
  auto t = target.detach().to(at::kLong);
  return [t, scale](const at::Tensor& out, const at::Tensor& out_magnitude) {
    const int64_t batch = out.size(0), classes = out.size(1);
    auto s = at::softmax(out, 1);
    auto onehot = at::one_hot(t, classes).to(at::kDouble);
    const double k = scale / static_cast<double>(batch);
    // The output's error: the softmax Jacobian's rows sum to at most 1/2 in absolute value, so
    // each element takes at most the row's largest output error. The softmax's own rounding:
    // exp of (o − max) errs relative to |o − max| (its condition number), the sum over the
    // classes by `classes` terms; the subtraction of the one-hot by one rounding.
    auto row_error = std::get<0>(out_magnitude.max(1, /*keepdim=*/true));
    auto spread = out - std::get<0>(out.max(1, /*keepdim=*/true));
    auto own = s * (spread.abs() + static_cast<double>(classes + 8));
    return LossGradient{(s - onehot) * k, (row_error + own + (s - onehot).abs()) * k};
  };
}

LossValue mse_value(const Exact& exact, const at::Tensor& target) {
  auto diff = exact.output - target.detach().to(at::kDouble);
  const auto n = static_cast<double>(diff.numel());
  return {diff.pow(2).sum().item<double>() / n,
          (diff.pow(2).sum() + 2 * (diff.abs() * exact.output_magnitude).sum()).item<double>() / n};
}

std::vector<at::Tensor> weights_of(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (auto& p : module.parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<at::Tensor> buffers_of(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (auto& b : module.buffers()) out.push_back(b.detach().clone());
  return out;
}

double forward_terms(const torch::nn::Module& module) {
  double terms = 0;
  for (auto& p : module.parameters()) {
    terms += 4;
    if (p.dim() >= 2) terms += static_cast<double>(p.numel() / p.size(0));
  }
  return terms;
}

double backward_terms(const torch::nn::Module& module) {
  double terms = 0;
  for (auto& p : module.parameters()) {
    terms += 4;
    if (p.dim() >= 2) terms += static_cast<double>(p.numel() / p.size(1));
  }
  return terms;
}

Exact exact_and_magnitudes(const MakeModule& make, const Forward& forward,
                           const std::vector<at::Tensor>& weights, const at::Tensor& input,
                           const LossGradientFn& loss, const std::vector<at::Tensor>& buffers) {
  struct Run {
    std::shared_ptr<torch::nn::Module> module;
    at::Tensor x, out;
  };
  auto start = [&](bool absolute) {
    Run r;
    r.module = make();
    r.module->to(at::kDouble);
    auto params = r.module->parameters();
    if (params.size() != weights.size()) {
      throw std::invalid_argument("exact_and_magnitudes: " + std::to_string(weights.size()) +
                                  " weights for " + std::to_string(params.size()) + " parameters");
    }
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        auto w = weights[i].detach().to(at::kCPU, at::kDouble);
        params[i].copy_(absolute ? w.abs() : w);
      }
      auto named = r.module->named_buffers();
      if (!buffers.empty() && buffers.size() != named.size()) {
        throw std::invalid_argument("exact_and_magnitudes: " + std::to_string(buffers.size()) +
                                    " buffers for " + std::to_string(named.size()));
      }
      for (size_t i = 0; i < buffers.size(); ++i) {
        auto& b = named[i].value();
        auto v = buffers[i].detach().to(at::kCPU, b.scalar_type());
        const bool mean =
            named[i].key().size() >= 12 &&
            named[i].key().compare(named[i].key().size() - 12, 12, "running_mean") == 0;
        b.copy_(absolute && mean ? -v.abs() : v);
      }
    }
    r.x = input.detach().to(at::kCPU, at::kDouble);
    if (absolute) r.x = r.x.abs();
    r.x.requires_grad_(true);
    r.out = forward(*r.module, r.x);
    return r;
  };
  Run mag = start(true);
  Run exact = start(false);
  LossGradient g = loss(exact.out.detach(), mag.out.detach());
  exact.out.backward(g.grad);
  mag.out.backward(g.magnitude.abs());

  Exact e;
  e.output = exact.out.detach();
  e.output_magnitude = mag.out.detach();
  auto pe = exact.module->parameters(), pm = mag.module->parameters();
  for (size_t i = 0; i < pe.size(); ++i) {
    e.grads.push_back(pe[i].grad().defined() ? pe[i].grad().detach() : at::Tensor());
    e.grad_magnitudes.push_back(pm[i].grad().defined() ? pm[i].grad().detach() : at::Tensor());
  }
  e.input_grad = exact.x.grad();
  e.input_grad_magnitude = mag.x.grad();
  return e;
}

double with_narrow_terms(double float_terms, double narrow_terms, at::ScalarType narrow) {
  return float_terms + narrow_terms * unit_roundoff(narrow) / unit_roundoff(at::kFloat);
}

void expect_gradients_within_rounding(const std::vector<at::Tensor>& got, const Exact& exact,
                                      double terms, const std::string& where, at::ScalarType dtype,
                                      double absolute) {
  ASSERT_EQ(got.size(), exact.grads.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool want = exact.grads[i].defined();
    ASSERT_EQ(got[i].defined(), want) << where << ", parameter " << i << ": gradient "
                                      << (want ? "missing" : "where none is due");
    if (want) {
      EXPECT_TRUE(
          within_rounding(got[i], exact.grads[i], exact.grad_magnitudes[i], terms, dtype, absolute))
          << where << ", parameter " << i;
    }
  }
}

}  // namespace scaletrain::testing
