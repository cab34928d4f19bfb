#pragma once
// How scaletrain calls a module it was given by its own type: DistributedDataParallel and
// DataParallel run `module->forward(x)` for module types whose forward takes one tensor and
// returns one (a torch::nn::Sequential, a TORCH_MODULE, a struct Net : torch::nn::Module with
// `at::Tensor forward(const at::Tensor&)`, default arguments after the first allowed).

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace scaletrain {

namespace detail {
template <typename M, typename = void>
struct TensorForward : std::false_type {};
template <typename M>
struct TensorForward<
    M, std::void_t<decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>()))>>
    : std::is_convertible<decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>())),
                          at::Tensor> {};
}  // namespace detail

/// Whether `module->forward(x)` takes one tensor and returns one for a module of type M.
template <typename M>
constexpr bool has_tensor_forward_v = detail::TensorForward<M>::value;

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

/// A function running `module->forward(x)` (it keeps the module alive), or an empty function
/// when M has no such forward.
template <typename M>
TensorFn tensor_forward(const std::shared_ptr<M>& module) {
  if constexpr (has_tensor_forward_v<M>) {
    return [module](const at::Tensor& x) -> at::Tensor { return module->forward(x); };
  } else {
    (void)module;
    return {};
  }
}

}  // namespace scaletrain
