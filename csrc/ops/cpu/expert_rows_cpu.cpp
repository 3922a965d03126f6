// add_expert_bias_, expert_row_sums and choice_rows on CPU: loops over the rows with
// at::parallel_for, in the arithmetic of the CUDA kernels (kernels/expert_rows.cu): the bias added
// in the accumulation type and rounded once, the sums taken row by row from +0 in the accumulation
// type, so both devices give the same bits.  Unlike the kernels, which cannot read values without
// a synchronisation, these check `offsets` (non-decreasing, within [0, N]) and the slot choices
// (within [0, T k)) and raise for bad ones.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../expert_rows_args.h"
#include "grouped_offsets.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

// Elements each parallel task should touch at least, so that small calls stay on one thread.
constexpr int64_t kGrainElements = 32768;
// Columns one expert_row_sums task sums (its accumulators fit in the L1 cache).
constexpr int64_t kSumColumns = 512;

void add_expert_bias_cpu(const at::Tensor& rows, const at::Tensor& bias_in, const at::Tensor& offsets_in) {
  const char* op = "add_expert_bias_";
  const ExpertBias checked = checked_add_expert_bias(rows, bias_in, offsets_in);
  const at::Tensor &bias = checked.bias, &offsets = checked.offsets;
  const int64_t experts = offsets.size(0), columns = rows.size(1);
  const int* ends = offsets.data_ptr<int>();
  check_offsets_values(ends, experts, rows.size(0), op);
  const int64_t grouped = experts == 0 ? 0 : ends[experts - 1];  // the rows past it keep their values
  if (grouped == 0 || columns == 0) return;
  const int64_t row_stride = rows.stride(0), bias_stride = bias.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "add_expert_bias_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* base = rows.data_ptr<scalar_t>();
    const scalar_t* shifts = bias.data_ptr<scalar_t>();
    at::parallel_for(0, grouped, std::max<int64_t>(1, kGrainElements / columns), [&](int64_t begin, int64_t end) {
      int64_t expert = std::upper_bound(ends, ends + experts, begin) - ends;  // the first end past `begin`
      for (int64_t r = begin; r < end; ++r) {
        while (ends[expert] <= r) ++expert;
        scalar_t* row = base + r * row_stride;
        const scalar_t* add = shifts + expert * bias_stride;
        for (int64_t c = 0; c < columns; ++c) row[c] = scalar_t(acc_t(row[c]) + acc_t(add[c]));
      }
    });
  });
}

at::Tensor expert_row_sums_cpu(const at::Tensor& rows_in, const at::Tensor& offsets_in) {
  const char* op = "expert_row_sums";
  const GroupedRows checked = checked_expert_row_sums(rows_in, offsets_in);
  const at::Tensor &rows = checked.rows, &offsets = checked.offsets;
  const int64_t experts = offsets.size(0), columns = rows.size(1);
  const int* ends = offsets.data_ptr<int>();
  check_offsets_values(ends, experts, rows.size(0), op);
  at::Tensor out = at::empty({experts, columns}, rows.options());
  if (out.numel() == 0) return out;
  const int64_t row_stride = rows.stride(0);
  const int64_t pieces = (columns + kSumColumns - 1) / kSumColumns, tasks = experts * pieces;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "expert_row_sums", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* base = rows.numel() > 0 ? rows.data_ptr<scalar_t>() : nullptr;
    scalar_t* sums = out.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(size_t(std::min(columns, kSumColumns)));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t e = task / pieces, first = (task % pieces) * kSumColumns;
        const int64_t width = std::min(kSumColumns, columns - first);
        std::fill(sum.begin(), sum.begin() + width, acc_t(0));
        // Row after row in increasing order, as each CUDA thread adds its column.
        for (int64_t r = e == 0 ? 0 : ends[e - 1]; r < ends[e]; ++r) {
          const scalar_t* row = base + r * row_stride + first;
          for (int64_t c = 0; c < width; ++c) sum[size_t(c)] += acc_t(row[c]);
        }
        for (int64_t c = 0; c < width; ++c) sums[e * columns + first + c] = scalar_t(sum[size_t(c)]);
      }
    });
  });
  return out;
}

at::Tensor choice_rows_cpu(const at::Tensor& x_in, const at::Tensor& slot_choices_in, int64_t k) {
  const char* op = "choice_rows";
  const ChoiceRows checked = checked_choice_rows(x_in, slot_choices_in, k);
  const at::Tensor &x = checked.x, &slot_choices = checked.slot_choices;
  const int64_t tokens = x.size(0), columns = x.size(1), slots = slot_choices.size(0);
  const int64_t* choices = slot_choices.data_ptr<int64_t>();
  // The first bad entry, found before anything is copied, so the message names the same one
  // whatever the threads do.
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK_INDEX(choices[s] >= 0 && choices[s] < tokens * k, "tutel::", op, ": `slot_choices`[", s, "] = ",
                      choices[s], " is out of range; choices must satisfy 0 <= choice < T k = ", tokens, " * ", k);
  // From the block cache: a fresh [N, H] buffer's page faults cost more than the copy itself.
  at::Tensor out = empty_reusable({slots, columns}, x.options());
  if (out.numel() == 0) return out;
  const int64_t row_bytes = columns * x.element_size(), x_stride_bytes = x.stride(0) * x.element_size();
  const char* source = static_cast<const char*>(x.data_ptr());
  char* target = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, slots, std::max<int64_t>(1, kGrainElements / columns), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      std::memcpy(target + s * row_bytes, source + (choices[s] / k) * x_stride_bytes, size_t(row_bytes));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("add_expert_bias_", &add_expert_bias_cpu);
  m.impl("expert_row_sums", &expert_row_sums_cpu);
  m.impl("choice_rows", &choice_rows_cpu);
}

}  // namespace ops
}  // namespace tutel
