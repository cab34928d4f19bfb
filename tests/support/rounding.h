#pragma once
// The arithmetic behind every float tolerance of the suite (Note [Tolerances] in
// support/tolerance.h), without LibTorch, for the tests of the LibTorch-free parts.

#include <cmath>
#include <limits>
#include <stdexcept>

namespace scaletrain::testing {

/// Half the gap from 1 to the next number of type T: 2^-24 (float), 2^-53 (double).
template <typename T>
constexpr double unit_roundoff_of() {
  return static_cast<double>(std::numeric_limits<T>::epsilon()) / 2;
}

/// Higham's gamma(K) = K·u / (1 − K·u) for unit roundoff u: a sum of K products computed in any
/// order errs by at most gamma(K) · Σ|terms|.
inline double gamma_of(double terms, double u) {
  const double ku = terms * u;
  if (ku >= 1) throw std::invalid_argument("gamma: K·u >= 1, no bound");
  return ku / (1 - ku);
}

/// The bound gamma(K) · magnitude for type T.
template <typename T>
double rounding_bound(double terms, double magnitude) {
  return gamma_of(terms, unit_roundoff_of<T>()) * std::abs(magnitude);
}

}  // namespace scaletrain::testing
