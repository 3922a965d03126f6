// How the host writes a kernel's parameter list (csrc/cuda/kernel_params.h, generated from
// kernels/), and the list a launch's arguments make, so that cuda::launch_kernel can compare the
// two at compile time: cuLaunchKernel copies each parameter's size from the address it is given,
// so an argument of another type than the kernel's parameter is read wrong on the GPU.
#pragma once

#include <cstddef>
#include <type_traits>

namespace tutel {
namespace cuda {

// Any pointer parameter: the element type is the kernel variant's, and the host passes void
// pointers to tensor data.
struct AnyPointer {};

template <class... Kinds>
struct KernelParams {};

template <class T>
struct ParamKind {
  using type = T;
};
template <class T>
struct ParamKind<T*> {
  using type = AnyPointer;
};
template <>
struct ParamKind<std::nullptr_t> {
  using type = AnyPointer;
};

// The parameter list that arguments of types Args fill.
template <class... Args>
using ParamsOf = KernelParams<typename ParamKind<typename std::remove_cv<Args>::type>::type...>;

}  // namespace cuda
}  // namespace tutel
