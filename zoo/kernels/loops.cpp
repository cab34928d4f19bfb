#include "kernels/loops.h"

#include <algorithm>

namespace scaletrain::kernels {
namespace {

// One window row of the forward: for each output column, the four taps' relu summed over c.
void forward_row(const float* __restrict top, const float* __restrict bottom, float* __restrict out,
                 int64_t out_w, int64_t c) {
  for (int64_t j = 0; j < out_w; ++j) {
    const float* a = top + 2 * j * c;
    const float* b = a + c;
    const float* d = bottom + 2 * j * c;
    const float* e = d + c;
    float* o = out + j * c;
    // Branch-free max (the compiler vectorises it); the order of the sum is avg_pool2d's.
    for (int64_t k = 0; k < c; ++k) {
      o[k] =
          (std::max(a[k], 0.f) + std::max(b[k], 0.f) + std::max(d[k], 0.f) + std::max(e[k], 0.f)) /
          4.f;
    }
  }
}

// One input row of the backward, within the pooled width.
void backward_row(const float* __restrict x, const float* __restrict g, float* __restrict gx,
                  int64_t out_w, int64_t c) {
  for (int64_t j = 0; j < out_w; ++j) {
    const float* gj = g + j * c;
    for (int dj = 0; dj < 2; ++dj) {
      const float* xr = x + (2 * j + dj) * c;
      float* o = gx + (2 * j + dj) * c;
      // A mask multiply, not a branch: x's signs are random, a branch mispredicts half the time.
      for (int64_t k = 0; k < c; ++k) o[k] = static_cast<float>(xr[k] > 0.f) * (gj[k] / 4.f);
    }
  }
}

}  // namespace

void relu_avg_pool2x2(const float* x, float* out, int64_t begin, int64_t end, int64_t h, int64_t w,
                      int64_t c) {
  const int64_t oh = h / 2, ow = w / 2;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t i = 0; i < oh; ++i) {
      const float* top = x + ((n * h + 2 * i) * w) * c;
      forward_row(top, top + w * c, out + ((n * oh + i) * ow) * c, ow, c);
    }
  }
}

void relu_avg_pool2x2_backward(const float* x, const float* grad_out, float* grad_x, int64_t begin,
                               int64_t end, int64_t h, int64_t w, int64_t c) {
  const int64_t oh = h / 2, ow = w / 2;
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t r = 0; r < h; ++r) {
      float* row = grad_x + ((n * h + r) * w) * c;
      if (r >= 2 * oh) {  // the dropped last row of an odd height
        std::fill_n(row, w * c, 0.f);
        continue;
      }
      backward_row(x + ((n * h + r) * w) * c, grad_out + ((n * oh + r / 2) * ow) * c, row, ow, c);
      std::fill_n(row + 2 * ow * c, (w - 2 * ow) * c, 0.f);  // the dropped last column
    }
  }
}

}  // namespace scaletrain::kernels
