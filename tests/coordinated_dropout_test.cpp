// Dropout across a tensor-parallel split (coordinated_dropout.h): every part of a tensor split
// over t ranks, each drawn from a generator in the same state, is that part of the unsplit
// tensor's dropout at degree 1. No process group: a part is numbers, and the ranks are the loop.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "scaletrain/coordinated_dropout.h"
#include "scaletrain/error.h"

namespace scaletrain {
namespace {

// Regression (CoordinatedDropoutOnlyInTheZoo): the masks that do not depend on the degree were
// drawn by the zoo's GPT alone, which is not installed; a program's own split model had no way
// to draw them. The library's helper gives, at degrees 1, 2 and 4 and along any dimension, the
// unsplit tensor's result bit for bit (each element is x · mask / (1 − p) either way).
TEST(CoordinatedDropout, PartsAreTheUnsplitTensorsDropoutAtEveryDegree) {
  const auto whole = at::randn({2, 8, 4}, at::kDouble);
  for (int64_t dim : {0, 1, -1}) {
    auto at_one = at::make_generator<at::CPUGeneratorImpl>(9);
    const auto want = coordinated_dropout(whole, {0.3, {}, at_one});
    EXPECT_GT((want == 0).sum().item<int64_t>(), 0) << "no element dropped";
    for (int64_t t : {2, 4}) {
      if (whole.size(dim) % t != 0) continue;
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < t; ++r) {
        auto same_state = at::make_generator<at::CPUGeneratorImpl>(9);
        const int64_t n = whole.size(dim) / t;
        parts.push_back(
            coordinated_dropout(whole.narrow(dim, r * n, n), {0.3, {dim, t, r}, same_state}));
      }
      EXPECT_TRUE(at::equal(at::cat(parts, dim), want)) << "degree " << t << ", dim " << dim;
    }
  }
  EXPECT_TRUE(at::equal(coordinated_dropout(whole, {0.0}), whole));
}

TEST(CoordinatedDropout, APartThatCannotBeIsNamed) {
  const auto x = at::ones({2, 4});
  auto expect = [&](const CoordinatedDropoutOptions& o, const std::string& part) {
    try {
      coordinated_dropout(x, o);
      ADD_FAILURE() << "no error for: " << part;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect({1.0}, "p 1.000000 is not a probability in [0, 1)");
  expect({0.1, {2, 2, 0}}, "a [2, 4] tensor cannot be part 0 of 2 along dimension 2");
  expect({0.1, {1, 2, 2}}, "cannot be part 2 of 2 along dimension 1");
}

}  // namespace
}  // namespace scaletrain
