// The tile products of quantized_products.h on AMX: each work item (an expert, 64 of its outputs)
// decodes its matrix rows straight into B tiles, 16 rows x 32 values a step (quantized_tile_steps_amx.h:
// the code bytes transposed and decoded in the tiles' layout; steps whose scales that cannot take go
// the slow way, decoded as floats, rounded and transposed in registers), and
// multiplies the expert's token rows, packed once per call as A tiles, with them while they are in
// the second-level cache: tile_products' packed [O, K] way, on decoded rows.
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cstring>
#include <vector>

#include "../core/parallel.h"
#include "quantized_products.h"
#include "tile_gemm.h"
#include "work_balance.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cmath>
#include <limits>

#include "amx_tiles.h"
#include "quantized_steps_avx512.h"
#include "quantized_tile_steps_amx.h"

namespace tutel {
namespace gemm {
namespace {

using namespace amx_tiles;

// Outputs per work item: four B tiles, whose rows are decoded once and then meet every token row.
constexpr int64_t kItemOutputs = 64;

// Step `step` of 16 matrix rows (those from `valid` on zero) as a B tile the slow way, which gives
// every value's bits as decode_step and bf16_32 define them: decoded as floats row by row, rounded
// to bfloat16 and transposed in registers (as pack_tile_rows packs a bfloat16 matrix's rows).
template <core::QuantFormat F>
TUTEL_AMX void transposed_step(const core::ByteTables& tables, const quantized_steps::RowCursor* rows, int64_t valid,
                               const quantized_steps::Step& step, PackedTile& out) {
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
  for (int64_t i = 0; i < kTileRows; ++i) _mm512_store_si512(out.pairs + i * kTileRows, r[i]);
}

// Whether a float factor f keeps every nonzero value times it (at least `smallest` in magnitude)
// a normal float, and every value a number: f is zero, or finite and at least 2^-126 / smallest.
inline bool keeps_normal(float f, float least_factor) {
  const float a = std::fabs(f);
  return a == 0.0f || (a >= least_factor && a <= std::numeric_limits<float>::max());
}

// How a step of a tile is decoded: transposed_step, a quantized_tile_steps function with the
// step's per-lane constants, or (fp8_block) fp8_table_step with its scale block's table.
enum StepWay : uint8_t { kSlowWay = 0, kLaneWay = 1, kTableWay = 2 };

// The per-lane constants of each step of one tile (16 matrix rows) for quantized_tile_steps, and
// each step's way (kSlowWay where the constants cannot give the slow way's bits): 32 words or
// floats a step.
//   mxfp4: the exponent term of each row's scale, when every scale keeps the values normal;
//   nvfp4: lanes 0..15 the factors of the step's first block per row, 16..31 of its second;
//   fp8_block: the scale times 256 of row j / 2 in lane j, of row 8 + j / 2 in lane 16 + j, when
//     the step lies in one block; where the rows share that block's scale (kTableWay), also the
//     block's table in block_tables (256 bytes per scale block of the row).
// `scale_rows`: each row's scale bytes (the fp4 formats; rows past `valid` pointing at zeros).
template <core::QuantFormat F>
TUTEL_AMX_DECODE void tile_lanes(const core::QuantizedMatrix& w, int64_t expert, const core::ByteTables& tables,
                                 const quantized_steps::RowCursor* rows, const uint8_t* const* scale_rows, int64_t valid,
                                 int64_t steps, uint32_t* words, float* floats, uint8_t* block_tables, uint8_t* way) {
  using namespace quantized_tile_steps;
  const Shuffles& sh = shuffles();
  const __mmask16 valid_lanes = __mmask16((uint32_t(1) << valid) - 1u);
  std::fill(way, way + steps, uint8_t(kLaneWay));
  if (F == core::QuantFormat::kMxfp4) {  // one scale byte per step
    for (int64_t s0 = 0; s0 < steps; s0 += 16) {
      const int count = int(std::min<int64_t>(16, steps - s0));
      __m512i octets[2][2];
      fp4_octets(scale_rows, s0, count, sh, octets);
      for (int c = 0; c < count; ++c) {
        const __m512i scale = octet_lanes(octets, c, sh);
        const __m512i add = _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(scale, _mm512_set1_epi32(127)), 7),
                                             _mm512_set1_epi32(0xffff));
        _mm512_storeu_si512(words + (s0 + c) * 32, _mm512_or_si512(add, _mm512_slli_epi32(add, 16)));
        // E2M1's nonzero values are 2^-1 .. 1.5 * 2^2: bfloat16 exponents 126 .. 129 before the add
        const __mmask16 extreme = _mm512_mask_cmplt_epi32_mask(valid_lanes, scale, _mm512_set1_epi32(2)) |
                                  _mm512_mask_cmpgt_epi32_mask(valid_lanes, scale, _mm512_set1_epi32(252));
        if (extreme) way[s0 + c] = kSlowWay;
      }
    }
  } else if (F == core::QuantFormat::kNvfp4) {  // two scale bytes per step (one in a last half step)
    std::fill(floats, floats + steps * 32, 0.0f);
    const int64_t blocks = w.cols / core::kNvfp4Block;
    const __m512 global = _mm512_set1_ps(w.global_scale(expert));
    // |factor| == 0, or finite and at least 2^-125: the least nonzero E2M1 is 2^-1
    const __m512 least = _mm512_set1_ps(0x1p-125f), most = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int count = int(std::min<int64_t>(16, blocks - b0));
      __m512i octets[2][2];
      fp4_octets(scale_rows, b0, count, sh, octets);
      for (int c = 0; c < count; ++c) {
        const int64_t block = b0 + c;
        const __m512 factor =
            _mm512_mul_ps(_mm512_i32gather_ps(octet_lanes(octets, c, sh), tables.e4m3, 4), global);
        _mm512_storeu_ps(floats + block / 2 * 32 + block % 2 * 16, factor);
        const __m512 size = _mm512_abs_ps(factor);
        const __mmask16 normal = _mm512_cmp_ps_mask(size, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                                 (_mm512_cmp_ps_mask(size, least, _CMP_GE_OQ) &
                                  _mm512_cmp_ps_mask(size, most, _CMP_LE_OQ));
        if (normal != 0xffff) way[block / 2] = kSlowWay;
      }
    }
  } else {
    // A step's way and lanes depend on its scale block alone: those of a block's first step serve
    // its other steps (block_cols / 32 of them where it is a multiple of 32).  Lanes are written
    // only for steps that take them (the table way reads none).
    int64_t block_step = -1, block = -1;
    for (int64_t s = 0; s < steps; ++s) {
      const quantized_steps::Step step = quantized_steps::step_at(w, s * kInnerStep);
      if (step.crossing) {
        way[s] = kSlowWay;
        continue;
      }
      if (step.block == block) {
        way[s] = way[block_step];
        if (way[s] == kLaneWay) std::copy(floats + block_step * 32, floats + block_step * 32 + 32, floats + s * 32);
        continue;
      }
      const float shared = rows[0].float_scales[step.block];
      bool uniform = true, normal = true;
      for (int64_t n = 0; n < valid; ++n) {
        uniform = uniform && std::memcmp(&rows[n].float_scales[step.block], &shared, sizeof(float)) == 0;
        // the least nonzero E4M3 is 2^-9, taken as 2^-17
        normal = normal && keeps_normal(rows[n].float_scales[step.block] * 256.0f, 0x1p-109f);
      }
      if (!normal) {
        way[s] = kSlowWay;
      } else if (uniform) {
        way[s] = kTableWay;
        fp8_scaled_table(tables.e4m3, shared, sh, block_tables + step.block * 256);
      } else {
        std::fill(floats + s * 32, floats + s * 32 + 32, 0.0f);
        for (int64_t n = 0; n < valid; ++n) {
          const float scale = rows[n].float_scales[step.block] * 256.0f;
          floats[s * 32 + 16 * (n / 8) + 2 * (n % 8)] = floats[s * 32 + 16 * (n / 8) + 2 * (n % 8) + 1] = scale;
        }
      }
      block_step = s;
      block = step.block;
    }
  }
}

// Matrix rows [o, o + 16 * tiles) of expert `expert` (zero from w.rows on and past w.cols) in the
// format F as B tiles, step after step: out[tiles * s + t] pairs values (k, k + 1) of step s for
// rows [o + 16 t, +16), as pack_tile_rows lays out a bfloat16 matrix's rows.  Each 16 rows are
// decoded together, step after step, so that each streams.
template <core::QuantFormat F>
TUTEL_AMX_DECODE void decode_matrix_tiles_of(const core::QuantizedMatrix& w, int64_t expert, int64_t o, int64_t tiles,
                                             PackedTile* out) {
  using namespace quantized_tile_steps;
  const core::ByteTables& tables = core::byte_tables();
  const Shuffles& sh = shuffles();
  const int64_t steps = inner_steps(w.cols);
  const int64_t row_bytes = w.code_bytes_per_row(), step_bytes = F == core::QuantFormat::kFp8Block ? 32 : 16;
  constexpr int64_t kPrefetchBytes = 512;
  // The tile's per-lane constants and tables, kept per thread between calls.
  static thread_local std::vector<uint32_t> words;
  static thread_local std::vector<float> floats;
  static thread_local std::vector<uint8_t> block_tables;
  static thread_local std::vector<uint8_t> way;
  // What rows past the matrix read: zeros, as long as a row's codes or scales.
  static thread_local std::vector<uint8_t> zeros;
  if (way.size() < size_t(steps)) {
    words.resize(size_t(steps * 32));
    floats.resize(size_t(steps * 32));
    way.resize(size_t(steps));
  }
  if (F == core::QuantFormat::kFp8Block) {
    const size_t table_bytes = size_t((w.cols + w.block_cols - 1) / w.block_cols * 256);
    if (block_tables.size() < table_bytes) block_tables.resize(table_bytes);
  }
  if (zeros.size() < size_t(w.code_bytes_per_row())) zeros.assign(size_t(w.code_bytes_per_row()), 0);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = o + t * kTileRows, valid = std::max<int64_t>(0, std::min(kTileRows, w.rows - first));
    quantized_steps::RowCursor rows[kTileRows];
    const uint8_t *codes[kTileRows], *scale_rows[kTileRows];
    for (int64_t i = 0; i < kTileRows; ++i) {
      if (i < valid) {
        rows[i] = quantized_steps::row_cursor(w, expert, first + i);
        codes[i] = rows[i].codes;
        scale_rows[i] = rows[i].byte_scales;
      } else {
        codes[i] = scale_rows[i] = zeros.data();
      }
    }
    tile_lanes<F>(w, expert, tables, rows, scale_rows, valid, steps, words.data(), floats.data(), block_tables.data(),
                  way.data());
    for (int64_t s = 0; s < steps; ++s) {
      PackedTile& tile = out[s * tiles + t];
      const int64_t k = s * kInnerStep;
      // Sixteen rows read 16 or 32 bytes a step are too many short streams for the hardware's
      // prefetch: each row's line kPrefetchBytes on is asked for as the step enters a line, past
      // a row's end the line of the row 16 on (the next tile's).
      if ((k * step_bytes / kInnerStep) % 64 == 0) {
        const int64_t ahead = k * step_bytes / kInnerStep + kPrefetchBytes;
        const int64_t at = ahead < row_bytes ? ahead : ahead - row_bytes + kTileRows * row_bytes;
        for (int64_t i = 0; i < valid; ++i) _mm_prefetch(reinterpret_cast<const char*>(codes[i] + at), _MM_HINT_T0);
      }
      if (way[size_t(s)] == kSlowWay) {
        transposed_step<F>(tables, rows, valid, quantized_steps::step_at(w, k), tile);
      } else if (F == core::QuantFormat::kMxfp4) {
        mxfp4_step(codes, k / 2, words.data() + s * 32, sh, tile);
      } else if (F == core::QuantFormat::kNvfp4) {
        nvfp4_step(codes, k / 2, w.cols - k < kInnerStep, floats.data() + s * 32, sh, tile);
      } else if (way[size_t(s)] == kTableWay) {
        fp8_table_step(codes, k, int(std::min(kInnerStep, w.cols - k)), block_tables.data() + k / w.block_cols * 256,
                       sh, tile);
      } else {
        fp8_step(codes, k, int(std::min(kInnerStep, w.cols - k)), floats.data() + s * 32, sh, tile);
      }
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

// Asks for the next item's codes (one byte range: an expert's rows are contiguous) to come into the
// second-level cache a few lines per tile step of this item's products, so that decoding it does not
// wait on memory while the tile unit idles, and these products do not wait on that reading.
class NextItemPrefetch {
 public:
  NextItemPrefetch() = default;
  NextItemPrefetch(const core::QuantizedMatrix& w, const QuantizedItem& next, int64_t tile_steps) {
    const int64_t row_bytes = w.code_bytes_per_row();
    first_ = reinterpret_cast<const char*>(w.row_codes(next.expert, next.o_begin));
    lines_ = ((next.o_end - next.o_begin) * row_bytes + 63) / 64;
    per_step_ = tile_steps > 0 ? (lines_ + tile_steps - 1) / tile_steps : lines_;
  }
  TUTEL_AMX void operator()() const {
    for (int64_t end = std::min(lines_, next_ + per_step_); next_ < end; ++next_)
      _mm_prefetch(first_ + next_ * 64, _MM_HINT_T1);
  }

 private:
  const char* first_ = nullptr;
  int64_t lines_ = 0, per_step_ = 0;
  mutable int64_t next_ = 0;
};

// One item: outputs [o_begin, o_end) of the expert's rows, whose A tiles are `rows`; `matrix`
// holds inner_steps x 4 tiles of scratch.  `next`: the item this thread runs next, or nullptr.
TUTEL_AMX void run_item(const QuantizedGroupedProducts<bfloat16>& call, const QuantizedItem& item,
                        const PackedTile* rows, PackedTile* matrix, const QuantizedItem* next) {
  const int64_t steps = inner_steps(call.w.cols), outputs = call.w.rows;
  const int64_t first_row = call.offsets[item.expert], row_count = call.offsets[item.expert + 1] - first_row;
  const int64_t blocks = (row_count + kTileRows - 1) / kTileRows;
  const int64_t tiles = (item.o_end - item.o_begin + kTileRows - 1) / kTileRows;
  const float* bias = call.bias ? call.bias + item.expert * outputs : nullptr;
  decode_matrix_tiles(call.w, item.expert, item.o_begin, tiles, matrix);
  const auto store = [&](int64_t b_begin, int64_t b_end, int64_t t, bool two_o, const float* sums) TUTEL_AMX {
    const int64_t o = item.o_begin + t * kTileRows;
    const int64_t n0 = std::min(kTileRows, item.o_end - o), n1 = std::min(kTileRows, item.o_end - o - kTileRows);
    const int64_t last = std::min(b_end * kTileRows, row_count);
    for (int64_t r = b_begin * kTileRows; r < last; ++r) {
      const float* const c = span_row_sums(sums, b_begin, r);
      bfloat16* const y = call.y + (first_row + r) * call.y_stride + o;
      store_with_bias(y, _mm512_load_ps(c), bias, o, n0);
      if (two_o) store_with_bias(y + kTileRows, _mm512_load_ps(c + kTileRows), bias, o + kTileRows, n1);
    }
  };
  const NextItemPrefetch prefetch =
      next ? NextItemPrefetch(call.w, *next, packed_product_tile_steps(steps, blocks, tiles)) : NextItemPrefetch();
  packed_rows_times_packed_matrix(rows, matrix, steps, blocks, tiles, store, prefetch);
}

// Runs the items this thread claims from `queue` until none is left.
TUTEL_AMX void run_items(const QuantizedGroupedProducts<bfloat16>& call, const std::vector<QuantizedItem>& items,
                         const PackedTile* packed, const std::vector<int64_t>& first_tile, WorkQueue& queue) {
  load_tile_config();
  // The decoded rows of an item, kept per thread between calls (inner x 64 bfloat16 values).
  static thread_local std::vector<PackedTile> matrix;
  const size_t matrix_tiles = size_t(inner_steps(call.w.cols) * kItemOutputs / kTileRows);
  if (matrix.size() < matrix_tiles) matrix.resize(matrix_tiles);
  // Each item is claimed one ahead, so that its codes can be read in while the one before runs.
  for (int64_t claimed = queue.claim(); claimed >= 0;) {
    const int64_t next = queue.claim();
    const QuantizedItem& item = items[size_t(claimed)];
    run_item(call, item, packed + first_tile[size_t(item.expert)], matrix.data(),
             next >= 0 ? &items[size_t(next)] : nullptr);
    claimed = next;
  }
  _tile_release();
}

}  // namespace

bool quantized_tile_products_available() {
  return tile_products_available() && quantized_tile_steps::quantized_tile_steps_available();
}

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
