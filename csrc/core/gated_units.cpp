// Portable gated units, the run-time choice of kernels, and the parallel driver.
#include "gated_units.h"

#include <algorithm>
#include <cmath>

#include "parallel.h"

namespace tutel {
namespace core {
namespace {

// Distance between a row's consecutive gate (and up) values.
inline int64_t step_of(const GatedUnit& unit) { return unit.interleaved ? 2 : 1; }

// min(g, limit) and clamp(u, -limit, limit), NaN staying NaN as in torch.clamp.
template <class A>
inline A clamp_gate(const GatedUnit& unit, A g) {
  return unit.clamped && g > A(unit.limit) ? A(unit.limit) : g;
}
template <class A>
inline A clamp_up(const GatedUnit& unit, A u) {
  if (!unit.clamped) return u;
  if (u > A(unit.limit)) return A(unit.limit);
  if (u < -A(unit.limit)) return -A(unit.limit);
  return u;
}

}  // namespace

template <class T>
void portable_forward_units(const GatedUnit& unit, const GatedRows<T>& p, int64_t row, int64_t unit_begin) {
  using A = acc_t<T>;
  const int64_t step = step_of(unit);
  const T* gate = p.gate + row * p.gate_stride;
  const T* up = p.up + row * p.up_stride;
  T* out = p.out + row * p.out_stride;
  const T *gate_bias = nullptr, *up_bias = nullptr;
  const bool biased = bias_of_row(p, row, &gate_bias, &up_bias);
  for (int64_t i = unit_begin; i < p.width; ++i) {
    A g_in = Scalar<T>::load(gate[step * i]), u_in = Scalar<T>::load(up[step * i]);
    if (biased) {  // in the accumulation type: no rounding to T in between
      g_in += Scalar<T>::load(gate_bias[step * i]);
      u_in += Scalar<T>::load(up_bias[step * i]);
    }
    const A g = clamp_gate(unit, g_in);
    const A u = clamp_up(unit, u_in);
    const A s = A(1) / (A(1) + std::exp(-A(unit.alpha) * g));
    out[i] = Scalar<T>::store((u + A(unit.up_offset)) * (g * s));
  }
}

template <class T>
void portable_backward_units(const GatedUnit& unit, const GatedRows<T>& p, int64_t row, int64_t unit_begin) {
  using A = acc_t<T>;
  const A limit = A(unit.limit), alpha = A(unit.alpha);
  const int64_t step = step_of(unit);
  const T* gate = p.gate + row * p.gate_stride;
  const T* up = p.up + row * p.up_stride;
  const T* grad = p.grad + row * p.grad_stride;
  T* out_gate = p.out + row * p.out_stride;
  T* out_up = p.out_up + row * p.out_up_stride;
  const T *gate_bias = nullptr, *up_bias = nullptr;
  const bool biased = bias_of_row(p, row, &gate_bias, &up_bias);
  for (int64_t i = unit_begin; i < p.width; ++i) {
    A g_in = Scalar<T>::load(gate[step * i]), u_in = Scalar<T>::load(up[step * i]);
    if (biased) {
      g_in += Scalar<T>::load(gate_bias[step * i]);
      u_in += Scalar<T>::load(up_bias[step * i]);
    }
    const A g = clamp_gate(unit, g_in), u = clamp_up(unit, u_in);
    const A dh = Scalar<T>::load(grad[i]);
    const A s = A(1) / (A(1) + std::exp(-alpha * g));
    const bool gate_passes = !unit.clamped || g_in <= limit;
    const bool up_passes = !unit.clamped || (u_in >= -limit && u_in <= limit);
    const A dg = gate_passes ? dh * (u + A(unit.up_offset)) * (s * (A(1) + alpha * g * (A(1) - s))) : A(0);
    const A du = up_passes ? dh * (g * s) : A(0);
    out_gate[step * i] = Scalar<T>::store(dg);
    out_up[step * i] = Scalar<T>::store(du);
  }
}

namespace {

template <class T>
void portable_forward(const GatedUnit& unit, const GatedRows<T>& p, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) portable_forward_units(unit, p, r, 0);
}

template <class T>
void portable_backward(const GatedUnit& unit, const GatedRows<T>& p, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) portable_backward_units(unit, p, r, 0);
}

template <class T>
const GatedKernels<T>& chosen_kernels() {
  static const GatedKernels<T>& chosen = avx2_gated_kernels<T>() ? *avx2_gated_kernels<T>()
                                                                  : portable_gated_kernels<T>();
  return chosen;
}

// Rows per parallel chunk: about 16K values, so a chunk outweighs the cost of handing it out.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, width)); }

template <class T>
void run_rows(GatedKernel<T> kernel, const GatedUnit& unit, const GatedRows<T>& rows) {
  if (rows.rows <= 0 || rows.width <= 0) return;
  parallel_for(0, rows.rows, row_grain(rows.width),
               [&](int64_t begin, int64_t end) { kernel(unit, rows, begin, end); });
}

}  // namespace

template <class T>
const GatedKernels<T>& portable_gated_kernels() {
  static const GatedKernels<T> kernels{&portable_forward<T>, &portable_backward<T>};
  return kernels;
}

template <class T>
void gated_forward(const GatedUnit& unit, const GatedRows<T>& rows) {
  run_rows(chosen_kernels<T>().forward, unit, rows);
}

template <class T>
void gated_backward(const GatedUnit& unit, const GatedRows<T>& rows) {
  run_rows(chosen_kernels<T>().backward, unit, rows);
}

template <class T>
void gated_forward_here(const GatedUnit& unit, const GatedRows<T>& rows) {
  if (rows.rows > 0 && rows.width > 0) chosen_kernels<T>().forward(unit, rows, 0, rows.rows);
}

#define TUTEL_INSTANTIATE_GATED(T)                                                                     \
  template void portable_forward_units<T>(const GatedUnit&, const GatedRows<T>&, int64_t, int64_t);  \
  template void portable_backward_units<T>(const GatedUnit&, const GatedRows<T>&, int64_t, int64_t); \
  template const GatedKernels<T>& portable_gated_kernels<T>();                 \
  template void gated_forward<T>(const GatedUnit&, const GatedRows<T>&);       \
  template void gated_backward<T>(const GatedUnit&, const GatedRows<T>&);      \
  template void gated_forward_here<T>(const GatedUnit&, const GatedRows<T>&);
TUTEL_INSTANTIATE_GATED(float)
TUTEL_INSTANTIATE_GATED(double)
TUTEL_INSTANTIATE_GATED(bfloat16)
TUTEL_INSTANTIATE_GATED(float16)
#undef TUTEL_INSTANTIATE_GATED

}  // namespace core
}  // namespace tutel
