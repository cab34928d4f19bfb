#pragma once
// Fused CPU kernels on raw float arrays (internal, not public API). Kept free of LibTorch so that
// this file alone is built with -O3 (vectorised loops) in seconds; src/models wraps them as
// autograd functions. See Note [Fused ReLU + pool] in src/kernels/ops.cpp.

#include <cstdint>

namespace scaletrain::kernels {

/// out = avg_pool2d(relu(x), 2): 2x2 windows, stride 2, odd last rows/columns dropped. Both NHWC
/// and dense: x is [n, h, w, c], out is [n, h/2, w/2, c]. Images [begin, end) of the n.
void relu_avg_pool2x2(const float* x, float* out, int64_t begin, int64_t end, int64_t h, int64_t w,
                      int64_t c);

/// The gradient of that with respect to x: grad_out / 4 where x > 0 inside a window, 0 elsewhere
/// (and in the dropped last row/column). grad_out is [n, h/2, w/2, c]; grad_x [n, h, w, c].
void relu_avg_pool2x2_backward(const float* x, const float* grad_out, float* grad_x, int64_t begin,
                               int64_t end, int64_t h, int64_t w, int64_t c);

}  // namespace scaletrain::kernels
