#pragma once
// Note [Tolerances]
// ~~~~~~~~~~~~~~~~~
// Every float result the suite compares gets its tolerance from the arithmetic, never from what
// one machine happened to print: ATen and oneDNN pick other kernels (another summation order,
// blocking, FMA or not) on an AVX2 core, an AVX-512 core and under ATEN_CPU_CAPABILITY=default,
// and a tolerance fitted on one of them fails on another.
//
// The rule. A float result that is a sum of products (a dot product, a convolution, a gradient
// summed over a batch), or a chain of such sums, errs from the exact value by at most
//
//     gamma(K) · M,    gamma(K) = K·u / (1 − K·u)     (Higham, Accuracy and Stability of
//                                                      Numerical Algorithms, §3.1 and §3.5)
//
// whatever the order, grouping or use of FMA: u is the unit roundoff of the type (2^-24 for
// float32), K the number of terms summed along the longest chain that leads to the result
// (forward fan-ins + backward fan-outs + the batch reduction + a few for the loss), and M the
// sum of the absolute values of every term, Σ|terms|.
//
// M comes from the network itself: run in float64 on |input| with |weights|, a network of
// linear and convolution layers, ReLU, pooling, sums and reshapes has non-negative
// pre-activations everywhere, so ReLU passes everything and every output is the Σ|terms| of its
// float computation; backward from the loss gradient's magnitude gives the Σ|terms| of every
// gradient the same way (exact_and_magnitudes below). Each side of a comparison (the
// distributed run, the single-device run, LibTorch's kernel, ours) is checked against the
// float64 result with that bound, instead of against the other side with a guessed number.
//
// Training runs are checked step by step: at each step the gradient the parallel run produced
// is compared with the exact gradient at the weights it holds at that step, so that rounding
// never compounds through the trajectory; replicas are compared with each other bit for bit.
// Layers without the property above (tanh, batch norm in training mode, softmax) are kept out
// of these tests' models, or bounded on their own (the loss gradient helpers below; batch norm
// in eval mode through its running mean, see exact_and_magnitudes).
//
// The bound is the worst case: tight on the small models of the transparency tests (a DDP
// average off by 0.05% fails them), loose on deep ones, where Σ|terms| dwarfs the result (on
// the random-weight ResNet-18 of the interop test an output 10% off fails, 1% passes). That is
// the price of a tolerance that no summation order on any core can break; a wrong weight, a
// missing term or a dropped micro-batch is still far outside it. `make test` runs these tests
// again under each CPU dispatch level below the machine's own (the `isa-<level>/` entries,
// tests/numeric_tests.txt), and `make test-isa` (scripts/test-isa.sh) under every level it has.

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support/rounding.h"

namespace scaletrain::testing {

/// Half the gap from 1 to the next number of the type: 2^-24 (float32), 2^-53 (float64),
/// 2^-11 (float16), 2^-8 (bfloat16). (rounding.h has the same for C++ types.)
double unit_roundoff(at::ScalarType dtype);

/// gamma(K) = K·u / (1 − K·u): the worst relative error of a K-term sum of products, in units of
/// Σ|terms|.
double gamma(double terms, at::ScalarType dtype = at::kFloat);

/// |got − exact| ≤ gamma(terms, dtype) · magnitude + absolute elementwise (plus terms × the
/// type's smallest normal, for underflow), where `exact` and `magnitude` are float64
/// (broadcastable to `got`); `absolute` is for errors that are not relative (a narrower type's
/// subnormal range). On failure, names the worst element, its values and the bound.
::testing::AssertionResult within_rounding(const at::Tensor& got, const at::Tensor& exact,
                                           const at::Tensor& magnitude, double terms,
                                           at::ScalarType dtype = at::kFloat, double absolute = 0);

/// `got` equal to `want` bit for bit (at::equal). On failure, says which differs, the shapes or
/// the largest difference against the largest value, so that rounding tells itself apart from
/// another computation.
::testing::AssertionResult bit_for_bit(const at::Tensor& got, const at::Tensor& want);

/// The same bound with one magnitude for every element.
::testing::AssertionResult within_rounding(const at::Tensor& got, double exact, double magnitude,
                                           double terms, at::ScalarType dtype = at::kFloat);

/// The gradient of a loss with respect to the network's output, exact (float64), and the
/// magnitude of its float computation's error sources: |its terms| plus the propagated
/// magnitude of the output's own error.
struct LossGradient {
  at::Tensor grad;       // dL/d output at the exact output
  at::Tensor magnitude;  // bound M with |float dL/d output − grad| ≤ gamma(K) · M
};
/// Given the exact output and its magnitude (from the |input|, |weights| run).
using LossGradientFn =
    std::function<LossGradient(const at::Tensor& output, const at::Tensor& output_magnitude)>;

/// mse_loss(output, target) with mean reduction, times `scale` (e.g. the number of micro-batches
/// whose losses are summed): 2·scale·(output − target)/numel.
LossGradientFn mse_gradient(const at::Tensor& target, double scale = 1);
/// cross_entropy(output, target) with mean reduction: (softmax(output) − onehot)/batch. The
/// softmax's Jacobian has row sums ≤ 1 in absolute value, so the output's error enters at most
/// once per element.
LossGradientFn cross_entropy_gradient(const at::Tensor& target, double scale = 1);

/// Exact outputs and gradients of a network, and their magnitudes (Note [Tolerances]).
struct Exact;

/// The value of mse_loss(output, target) (mean reduction) at the exact output, and the magnitude
/// of its float computation: Σ(o − y)²/n plus the output's error, (2/n)·Σ|o − y|·M_o.
struct LossValue {
  double exact = 0, magnitude = 0;
};
LossValue mse_value(const Exact& exact, const at::Tensor& target);

/// Exact outputs and gradients of a network, and their magnitudes (Note [Tolerances]).
struct Exact {
  at::Tensor output, output_magnitude;
  std::vector<at::Tensor> grads, grad_magnitudes;  // per parameter, in parameters() order;
                                                   // undefined for a parameter forward skips
  at::Tensor input_grad, input_grad_magnitude;
};

using MakeModule = std::function<std::shared_ptr<torch::nn::Module>()>;
using Forward = std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>;

/// Builds the network twice with `make` in float64, loads `weights` (values in parameters()
/// order, any dtype) and then their absolute values, runs `forward` on `input` and on |input|, and
/// backward from `loss`'s gradient and from its magnitude. `buffers` (in buffers() order), when
/// given, are loaded too: batch norm in eval mode subtracts its running mean, so the magnitude
/// run takes −|running_mean| there, and x − mean adds magnitudes as a sum does.
Exact exact_and_magnitudes(const MakeModule& make, const Forward& forward,
                           const std::vector<at::Tensor>& weights, const at::Tensor& input,
                           const LossGradientFn& loss, const std::vector<at::Tensor>& buffers = {});

/// The current values of a module's parameters (detached copies), in parameters() order.
std::vector<at::Tensor> weights_of(const torch::nn::Module& module);
/// The same for its buffers, in buffers() order.
std::vector<at::Tensor> buffers_of(const torch::nn::Module& module);

/// A conservative length of a network's longest forward chain of sums: the fan-in of every weight
/// (its elements per output), plus 4 per parameter tensor (a bias, a normalisation's scale and
/// shift, a residual sum), whether or not the weights lie on one path.
double forward_terms(const torch::nn::Module& module);
/// The same for the backward's chain into the input: the fan-out of every weight (its elements
/// per input channel or feature), plus 4 per parameter tensor.
double backward_terms(const torch::nn::Module& module);

/// Checks gradients against exact_and_magnitudes()'s, parameter by parameter: `got[i]`
/// undefined exactly where the exact gradient is, else within_rounding(). `where` prefixes the
/// failure messages.
void expect_gradients_within_rounding(const std::vector<at::Tensor>& got, const Exact& exact,
                                      double terms, const std::string& where,
                                      at::ScalarType dtype = at::kFloat, double absolute = 0);

/// Terms in float32 units that bound, with gamma(), K float32 terms plus `narrow_terms` terms
/// rounded in a narrower type (fp16/bf16 on the wire): gamma(K) + gamma_narrow(n) ≤
/// gamma(K + n·u_narrow/u_float) to first order.
double with_narrow_terms(double float_terms, double narrow_terms, at::ScalarType narrow);

}  // namespace scaletrain::testing
