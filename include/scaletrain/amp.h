#pragma once
// Mixed precision, as torch.autocast and torch.amp.GradScaler do it in Python.
//
//   scaletrain::GradScaler scaler;                     // fp16 needs loss scaling; bf16 does not
//   {
//     scaletrain::Autocast amp(at::kCUDA, at::kHalf);  // matmuls and convs in fp16
//     loss = loss_fn(model(x), y);
//   }
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);                            // skipped when a gradient is inf/NaN
//   scaler.update();
//
// GradScaler keeps the scale as a one-element tensor on the gradients' device and uses
// ATen's own kernels (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_), on
// CUDA and on CPU. Under DDP the gradients are already averaged when step() runs, so every
// rank finds the same inf/NaN and skips the same steps. Where ranks hold different gradients
// (tensor parallelism: each its slices), GradScalerOptions::agree_over sums the verdict over
// their group, so that they skip together.

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <map>
#include <string>

namespace torch::optim {
class Optimizer;
}

namespace scaletrain {

struct Dist;

/// Autocast on `device` to `dtype` for this thread while the object lives (nests).
class Autocast {
 public:
  Autocast(c10::DeviceType device, c10::ScalarType dtype);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType old_dtype_;
};

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, PyTorch's default
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;  // disabled: scale() and step() pass through
  /// Collective: step() skips when any rank of this group found an inf or NaN (every rank of it
  /// calls step() together). Null: this rank's own gradients decide. It must outlive the scaler.
  const Dist* agree_over = nullptr;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// loss × scale.
  at::Tensor scale(const at::Tensor& loss);
  /// Unscales the optimizer's gradients in place and steps unless one is inf or NaN. Returns
  /// whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Halves the scale after a skipped step; doubles it after growth_interval good ones.
  void update();
  double current_scale() const;

  /// The scale and the count of good steps since the last change, for a checkpoint (CPU
  /// tensors "scale" and "growth_tracker"; empty before the first scale()), and back: a run
  /// resumed with it scales and skips exactly as the uninterrupted run does.
  std::map<std::string, at::Tensor> state() const;
  void load_state(const std::map<std::string, at::Tensor>& state);

 private:
  GradScalerOptions o_;
  at::Tensor scale_, growth_tracker_, found_inf_;
};

}  // namespace scaletrain
