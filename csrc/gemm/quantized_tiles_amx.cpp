// The tile products of quantized_products.h on AMX: each work item (an expert, 64 of its outputs)
// decodes its matrix rows straight into B tiles, 16 rows x 32 values a step (decoded, rounded to
// bfloat16 and transposed in registers, as tile_gemm_amx.cpp packs a bfloat16 matrix's rows), and
// multiplies the expert's token rows, packed once per call as A tiles, with them while they are in
// the second-level cache: tile_products' packed [O, K] way, on decoded rows.
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <vector>

#include "../core/parallel.h"
#include "quantized_products.h"
#include "tile_gemm.h"
#include "work_balance.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include "amx_tiles.h"
#include "quantized_steps_avx512.h"

namespace tutel {
namespace gemm {
namespace {

using namespace amx_tiles;

// Outputs per work item: four B tiles, whose rows are decoded once and then meet every token row.
constexpr int64_t kItemOutputs = 64;

// Matrix rows [o, o + 16 * tiles) of expert `expert` (zero from w.rows on and past w.cols) in the
// format F as B tiles, step after step: out[tiles * s + t] pairs values (k, k + 1) of step s for
// rows [o + 16 t, +16), as pack_tile_rows lays out a bfloat16 matrix's rows.  Each 16 rows are
// decoded together, step after step, so that each streams.
template <core::QuantFormat F>
TUTEL_AMX void decode_matrix_tiles_of(const core::QuantizedMatrix& w, int64_t expert, int64_t o, int64_t tiles,
                                      PackedTile* out) {
  const core::ByteTables& tables = core::byte_tables();
  const int64_t steps = inner_steps(w.cols);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = o + t * kTileRows, valid = std::max<int64_t>(0, std::min(kTileRows, w.rows - first));
    quantized_steps::RowCursor rows[kTileRows];
    for (int64_t i = 0; i < valid; ++i) rows[i] = quantized_steps::row_cursor(w, expert, first + i);
    for (int64_t s = 0; s < steps; ++s) {
      const quantized_steps::Step step = quantized_steps::step_at(w, s * kInnerStep);
      __m512i r[16];
      for (int64_t i = 0; i < kTileRows; ++i) {
        if (i < valid) {
          __m512 values[2];
          quantized_steps::decode_step<F>(tables, rows[i], step, values);
          r[i] = avx512::bf16_32(values[0], values[1]);
        } else {
          r[i] = _mm512_setzero_si512();
        }
      }
      transpose_16x16(r);
      for (int64_t i = 0; i < kTileRows; ++i) _mm512_store_si512(out[s * tiles + t].pairs + i * kTileRows, r[i]);
    }
  }
}

void decode_matrix_tiles(const core::QuantizedMatrix& w, int64_t expert, int64_t o, int64_t tiles, PackedTile* out) {
  switch (w.format) {
    case core::QuantFormat::kMxfp4: return decode_matrix_tiles_of<core::QuantFormat::kMxfp4>(w, expert, o, tiles, out);
    case core::QuantFormat::kNvfp4: return decode_matrix_tiles_of<core::QuantFormat::kNvfp4>(w, expert, o, tiles, out);
    case core::QuantFormat::kFp8Block:
      return decode_matrix_tiles_of<core::QuantFormat::kFp8Block>(w, expert, o, tiles, out);
  }
}

// Token rows [first, first + count) of x (count <= 16) as A tiles, one per step.
TUTEL_AMX void pack_token_block(const bfloat16* first, int64_t stride, int64_t count, int64_t inner, PackedTile* out) {
  pack_tile_rows(first, stride, count, inner, false, out, 1);
}

// Sixteen sums plus the float bias of outputs [o, o + n), stored to y as bfloat16.
TUTEL_AMX inline void store_with_bias(bfloat16* y, __m512 sums, const float* bias, int64_t o, int64_t n) {
  if (bias) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(__mmask16((uint32_t(1) << n) - 1u), bias + o));
  store_outputs(y, sums, n);
}

// One item: outputs [o_begin, o_end) of the expert's rows, whose A tiles are `rows`; `matrix`
// holds inner_steps x 4 tiles of scratch.  The loop of tile_gemm_amx.cpp's outputs_by_inner_packed.
TUTEL_AMX void run_item(const QuantizedGroupedProducts<bfloat16>& call, const QuantizedItem& item,
                        const PackedTile* rows, PackedTile* matrix) {
  constexpr int64_t kRow = 2 * kTileRows, kDown = kTileRows * kRow, kBlock = 2 * kDown;
  alignas(64) float sums[kPackedSpanBlocks / 2 * kBlock];
  const int64_t steps = inner_steps(call.w.cols), outputs = call.w.rows;
  const int64_t first_row = call.offsets[item.expert], row_count = call.offsets[item.expert + 1] - first_row;
  const int64_t blocks = (row_count + kTileRows - 1) / kTileRows;
  const int64_t tiles = (item.o_end - item.o_begin + kTileRows - 1) / kTileRows;
  const float* bias = call.bias ? call.bias + item.expert * outputs : nullptr;
  decode_matrix_tiles(call.w, item.expert, item.o_begin, tiles, matrix);
  for (int64_t b_begin = 0; b_begin < blocks; b_begin += kPackedSpanBlocks) {
    const int64_t b_end = std::min(blocks, b_begin + kPackedSpanBlocks);
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool two_o = tiles - t > 1;
      for (int64_t b = b_begin; b < b_end; b += 2) {
        float* const c = sums + (b - b_begin) / 2 * kBlock;
        const BlockSums block_sums{{{c, c + kTileRows}, {c + kDown, c + kDown + kTileRows}},
                                   kRow * int64_t(sizeof(float)), false};
        run_block(b_end - b > 1, two_o, PackedRowsTimesPackedMatrix{rows, matrix, steps, b, tiles, t}, steps,
                  block_sums);
      }
      const int64_t o = item.o_begin + t * kTileRows;
      const int64_t n0 = std::min(kTileRows, item.o_end - o), n1 = std::min(kTileRows, item.o_end - o - kTileRows);
      const int64_t last = std::min(b_end * kTileRows, row_count);
      for (int64_t r = b_begin * kTileRows; r < last; ++r) {
        const int64_t q = r / (2 * kTileRows) - b_begin / 2, in_pair = r % (2 * kTileRows);
        const float* const c = sums + q * kBlock + in_pair * kRow;
        bfloat16* const y = call.y + (first_row + r) * call.y_stride + o;
        store_with_bias(y, _mm512_load_ps(c), bias, o, n0);
        if (two_o) store_with_bias(y + kTileRows, _mm512_load_ps(c + kTileRows), bias, o + kTileRows, n1);
      }
    }
  }
}

// Runs the items this thread claims from `queue` until none is left.
TUTEL_AMX void run_items(const QuantizedGroupedProducts<bfloat16>& call, const std::vector<QuantizedItem>& items,
                         const PackedTile* packed, const std::vector<int64_t>& first_tile, WorkQueue& queue) {
  load_tile_config();
  // The decoded rows of an item, kept per thread between calls (inner x 64 bfloat16 values).
  static thread_local std::vector<PackedTile> matrix;
  const size_t matrix_tiles = size_t(inner_steps(call.w.cols) * kItemOutputs / kTileRows);
  if (matrix.size() < matrix_tiles) matrix.resize(matrix_tiles);
  for (int64_t claimed = queue.claim(); claimed >= 0; claimed = queue.claim()) {
    const QuantizedItem& item = items[size_t(claimed)];
    run_item(call, item, packed + first_tile[size_t(item.expert)], matrix.data());
  }
  _tile_release();
}

}  // namespace

bool quantized_tile_products_available() { return tile_products_available(); }

void quantized_tile_products(const QuantizedGroupedProducts<bfloat16>& call) {
  const int64_t inner = call.w.cols, steps = inner_steps(inner);
  const std::vector<QuantizedItem> items = quantized_items(call.offsets, call.experts, call.w.rows, kItemOutputs);
  if (items.empty()) return;
  // Every expert's token rows packed once, up front, by every thread: (expert, block of 16 rows).
  std::vector<int64_t> first_tile(size_t(call.experts) + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t e = 0; e < call.experts; ++e) {
    const int64_t count = (call.offsets[e + 1] - call.offsets[e] + kTileRows - 1) / kTileRows;
    for (int64_t b = 0; b < count; ++b) blocks.push_back({e, b});
    first_tile[size_t(e) + 1] = first_tile[size_t(e)] + count * steps;
  }
  // Kept per calling thread between calls, as tile_products' packed rows are.
  static thread_local std::vector<PackedTile> packed;
  if (packed.size() < size_t(first_tile.back())) packed.resize(size_t(first_tile.back()));
  PackedTile* const tiles = packed.data();
  core::parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [expert, block] = blocks[size_t(i)];
      const int64_t first = call.offsets[expert] + block * kTileRows;
      pack_token_block(call.x + first * call.x_stride, call.x_stride,
                       std::min(kTileRows, call.offsets[expert + 1] - first), inner,
                       tiles + first_tile[size_t(expert)] + block * steps);
    }
  });
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  WorkQueue queue(std::move(order));
  core::parallel_for(0, core::max_parallelism(), 1,
                     [&](int64_t, int64_t) { run_items(call, items, tiles, first_tile, queue); });
}

}  // namespace gemm
}  // namespace tutel

#else

namespace tutel {
namespace gemm {

bool quantized_tile_products_available() { return false; }

void quantized_tile_products(const QuantizedGroupedProducts<bfloat16>&) {}

}  // namespace gemm
}  // namespace tutel

#endif
