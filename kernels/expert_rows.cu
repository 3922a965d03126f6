// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Rows grouped by expert: a [N, C] tensor whose rows 0 .. ends[0] - 1 belong to expert 0, then
// ends[0] .. ends[1] - 1 to expert 1, ...; `ends` [E] int32 holds each expert's (non-decreasing)
// end, and the rows past ends[E - 1] belong to no expert.  One launch each:
//   add_expert_bias   rows[i] += bias[e(i)] in place for the rows of some expert
//                     (tutel::add_expert_bias_), one rounding to the data type;
//   expert_row_sums   out[e] = the sum of expert e's rows, in row order in the accumulation type
//                     (tutel::expert_row_sums: a per-expert bias's gradient, no atomics);
//   choice_rows       out[s] = x[slot_choices[s] / k] (tutel::choice_rows: the token rows in a
//                     routing plan's slot order).
// The rows' (and x's) elements are contiguous within a row, any row stride.  add_expert_bias and
// choice_rows give each thread one element, or one 16-byte vector of them where the host found
// every row pointer and row stride aligned (`vector`); expert_row_sums gives each thread one
// (expert, column), so a warp reads consecutive columns of one row at a time.  Values in `ends`
// beyond [0, N] or out of order, and slot choices outside [0, tokens k), never lead outside the
// tensors: the host checks neither (that would need a synchronisation), so the kernels clamp the
// ranges they walk and write zero rows for such choices.
#include "tutel_device.cuh"

// The (row, unit) of this thread over `rows` rows of `units` units each; false past the last.
__device__ __forceinline__ bool row_unit_of_thread(i64 rows, i64 units, i64& row, i64& unit) {
  const i64 flat = (i64)blockIdx.x * TUTEL_BLOCK_THREADS + threadIdx.x;
  if (flat >= rows * units) return false;
  row = flat / units;
  unit = flat - row * units;
  return true;
}

typedef Pack<TUTEL_VECTOR_WIDTH> Vector;

// rows [n, columns] (row stride row_stride) += bias [experts, columns] (row stride bias_stride)
// row by row, each row taking its expert's bias; the rows of no expert are left untouched.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    add_expert_bias(storage_t* rows, i64 row_stride, const storage_t* bias, i64 bias_stride, const int* ends,
                    i64 experts, i64 n, i64 columns, int vector) {
  const i64 width = vector ? TUTEL_VECTOR_WIDTH : 1;
  i64 row, unit;
  if (!row_unit_of_thread(n, columns / width, row, unit)) return;
  const i64 expert = expert_of_grouped_row(ends, experts, row);
  if (expert >= experts) return;
  storage_t* target = rows + row * row_stride + unit * width;
  const storage_t* add = bias + expert * bias_stride + unit * width;
  if (vector) {
    Vector values = *reinterpret_cast<const Vector*>(target);
    const Vector shifts = *reinterpret_cast<const Vector*>(add);
#pragma unroll
    for (int i = 0; i < TUTEL_VECTOR_WIDTH; ++i) values.v[i] = from_acc(to_acc(values.v[i]) + to_acc(shifts.v[i]));
    *reinterpret_cast<Vector*>(target) = values;
  } else {
    *target = from_acc(to_acc(*target) + to_acc(*add));
  }
}

// out [experts, columns] (contiguous): out[e][c] = the sum over expert e's rows r, in increasing
// r, of rows[r][c] (row stride row_stride), from +0 in the accumulation type; an idle expert's is 0.
// Four rows' loads are issued before their additions (in row order), so that each thread keeps
// several reads in flight.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    expert_row_sums(const storage_t* rows, i64 row_stride, const int* ends, i64 experts, i64 n, i64 columns,
                    storage_t* out) {
  const i64 flat = (i64)blockIdx.x * TUTEL_BLOCK_THREADS + threadIdx.x;
  if (flat >= experts * columns) return;
  const i64 expert = flat / columns, column = flat - expert * columns;
  i64 begin = expert == 0 ? 0 : (i64)ends[expert - 1];
  i64 end = ends[expert];
  if (begin < 0) begin = 0;
  if (end > n) end = n;
  acc_t sum = acc_t(0);
  i64 r = begin;
  for (; r + 4 <= end; r += 4) {
    const storage_t* at = rows + r * row_stride + column;
    const storage_t a = at[0], b = at[row_stride], c = at[2 * row_stride], d = at[3 * row_stride];
    sum += to_acc(a);
    sum += to_acc(b);
    sum += to_acc(c);
    sum += to_acc(d);
  }
  for (; r < end; ++r) sum += to_acc(rows[r * row_stride + column]);
  out[flat] = from_acc(sum);
}

// out [n, columns] (contiguous): row s is x's row slot_choices[s] / k (x [tokens, columns], row
// stride x_stride), or zeros for a choice outside [0, tokens k).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    choice_rows(const storage_t* x, i64 x_stride, i64 tokens, const i64* slot_choices, i64 k, i64 n, i64 columns,
                storage_t* out, int vector) {
  const i64 width = vector ? TUTEL_VECTOR_WIDTH : 1;
  i64 row, unit;
  if (!row_unit_of_thread(n, columns / width, row, unit)) return;
  const i64 choice = slot_choices[row];
  const i64 token = choice >= 0 ? choice / k : tokens;
  storage_t* target = out + row * columns + unit * width;
  const bool valid = token < tokens;
  if (vector) {
    Vector values;
    if (valid) {
      values = *reinterpret_cast<const Vector*>(x + token * x_stride + unit * width);
    } else {
#pragma unroll
      for (int i = 0; i < TUTEL_VECTOR_WIDTH; ++i) values.v[i] = storage_t(0);
    }
    *reinterpret_cast<Vector*>(target) = values;
  } else {
    *target = valid ? x[token * x_stride + unit] : storage_t(0);
  }
}
