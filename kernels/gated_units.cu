// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// The experts' gated units (tutel::gated_unit, gated_unit_pair and their backward passes;
// csrc/core/gated_units.h has the rule), one launch each:
//     h   = (u' + up_offset) * g' * s,   s = sigmoid(alpha g'),  g' = min(g, limit),
//     u'  = clamp(u, -limit, limit)      (no clamping unless `clamped`)
//     d g = d h (u' + up_offset) s (1 + alpha g' (1 - s))   where g <= limit, else 0
//     d u = d h g' s                                         where |u| <= limit, else 0
// Gates and ups are read through two row pointers with their row strides and a step between
// consecutive units (2 for gpt-oss' interleaved layout, where both point into one row), so one
// [n, 2I] gate_up tensor and separate [n, I] gates and ups take the same kernels.  One thread
// per unit over the flattened [n, I] result, so narrow rows fill whole blocks.  Arithmetic in
// the accumulation type with the operations of csrc/core's portable kernels in their order: in
// the kernels-on-CPU build the results are theirs bit for bit; on a GPU they differ by the
// exponential's ulps before the rounding to the storage type.
//
// With a per-expert bias (rows grouped by expert, TutelGatedOperands' expert_ends), g and u are
// gate + gate bias and up + up bias of the row's expert, added in the accumulation type (no
// rounding to the storage type in between) before the clamp, as the core kernels add them; each
// thread finds its row's expert by a binary search of the ends, so the call stays one launch.
#include "tutel_device.cuh"

__device__ __forceinline__ float unit_exp(float x) { return expf(x); }
__device__ __forceinline__ double unit_exp(double x) { return exp(x); }

// The (row, unit) of this thread; false past the last unit.
__device__ __forceinline__ bool unit_of_thread(const TutelGatedOperands& p, i64& row, i64& i) {
  const i64 flat = (i64)blockIdx.x * TUTEL_BLOCK_THREADS + threadIdx.x;
  if (flat >= p.rows * p.width) return false;
  row = flat / p.width;
  i = flat - row * p.width;
  return true;
}

// g and u of unit i of `row`, the expert's bias added when the rows have one.
__device__ __forceinline__ void load_unit(const TutelGatedOperands& p, i64 row, i64 i, acc_t& g, acc_t& u) {
  g = to_acc(static_cast<const storage_t*>(p.gate)[row * p.gate_stride + p.step * i]);
  u = to_acc(static_cast<const storage_t*>(p.up)[row * p.up_stride + p.step * i]);
  if (p.expert_ends == 0) return;
  const i64 expert = expert_of_grouped_row(p.expert_ends, p.experts, row);
  if (expert >= p.experts) return;  // past the last expert's rows: no bias
  g += to_acc(static_cast<const storage_t*>(p.gate_bias)[expert * p.bias_stride + p.step * i]);
  u += to_acc(static_cast<const storage_t*>(p.up_bias)[expert * p.bias_stride + p.step * i]);
}

// g' = min(g, limit) and u' = clamp(u, -limit, limit) when the unit clamps; NaN stays NaN, as
// in torch.clamp.
__device__ __forceinline__ void clamp_unit(const TutelGatedUnit& unit, acc_t& g, acc_t& u) {
  if (!unit.clamped) return;
  const acc_t limit = acc_t(unit.limit);
  if (g > limit) g = limit;
  if (u > limit) {
    u = limit;
  } else if (u < -limit) {
    u = -limit;
  }
}

// h [rows, I] (row stride out_stride).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    gated_unit_forward(TutelGatedOperands p, storage_t* out, i64 out_stride, TutelGatedUnit unit) {
  i64 row, i;
  if (!unit_of_thread(p, row, i)) return;
  acc_t g, u;
  load_unit(p, row, i, g, u);
  clamp_unit(unit, g, u);
  const acc_t s = acc_t(1) / (acc_t(1) + unit_exp(-acc_t(unit.alpha) * g));
  out[row * out_stride + i] = from_acc((u + acc_t(unit.up_offset)) * (g * s));
}

// d gate and d up, laid out like the gates and ups (each with its row stride and the
// operands' step), from d h [rows, I] (row stride grad_stride).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    gated_unit_backward(TutelGatedOperands p, const storage_t* grad, i64 grad_stride, storage_t* d_gate,
                        i64 d_gate_stride, storage_t* d_up, i64 d_up_stride, TutelGatedUnit unit) {
  i64 row, i;
  if (!unit_of_thread(p, row, i)) return;
  acc_t g_in, u_in;
  load_unit(p, row, i, g_in, u_in);
  acc_t g = g_in, u = u_in;
  clamp_unit(unit, g, u);
  const acc_t limit = acc_t(unit.limit), alpha = acc_t(unit.alpha);
  const acc_t dh = to_acc(grad[row * grad_stride + i]);
  const acc_t s = acc_t(1) / (acc_t(1) + unit_exp(-alpha * g));
  // Ordered comparisons: a NaN input passes no gradient, as in torch.clamp's backward.
  const bool gate_passes = !unit.clamped || g_in <= limit;
  const bool up_passes = !unit.clamped || (u_in >= -limit && u_in <= limit);
  const acc_t dg =
      gate_passes ? dh * (u + acc_t(unit.up_offset)) * (s * (acc_t(1) + alpha * g * (acc_t(1) - s))) : acc_t(0);
  const acc_t du = up_passes ? dh * (g * s) : acc_t(0);
  d_gate[row * d_gate_stride + p.step * i] = from_acc(dg);
  d_up[row * d_up_stride + p.step * i] = from_acc(du);
}
