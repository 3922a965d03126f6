// Routed experts whose weights are quantized (MXFP4, NVFP4, block-scaled FP8), at decoding sizes,
// on the CPU:
//
//   out[t] = sum_j w[t, j] * (unit(x[t] @ Wgu[e]^T + bgu[e]) @ Wd[e]^T + bd[e]),  e = ids[t, j] in [0, E)
//
// with Wgu and Wd decoded from their codes and scales (quant_codes.h) as they are read, never
// stored whole.  The work runs in two parallel passes:
//
//   1. gate/up: each (active expert, block of hidden units) item streams the expert's gate and up
//      rows of those units once, decodes them in registers, takes the dot products with every
//      token that chose the expert and applies the unit, leaving h [choices, I] in float32;
//   2. down: each block of output rows streams those rows of every active expert once, takes the
//      dot products with the expert's h rows and adds w * (dot + bias) into the tokens' float32
//      sums, then rounds its block of the output to the storage type.
//
// Each weight byte of an active expert is read once per call however many tokens chose it (for
// up to four tokens of an expert, eight with AVX-512, the codes are decoded once; more tokens
// decode them again per four or eight, from the cache).  Sums are float32 throughout, the unit is
// evaluated in float32, and h is rounded to the storage type, as the model's experts and the
// prefill operator (quantized_grouped_linear) keep it between the products.  Ids outside [0, E) are dropped
// choices.
#pragma once

#include <cstdint>

#include "gated_units.h"
#include "quant_codes.h"
#include "scalar.h"

namespace tutel {
namespace core {

// One stack of expert matrices [E, N, K] in a quantized format.  Every array is contiguous.
struct QuantizedMatrix {
  QuantFormat format = QuantFormat::kMxfp4;
  const uint8_t* codes = nullptr;  // [E, N, K / 2] for the fp4 formats, [E, N, K] for fp8_block
  int64_t rows = 0;                // N
  int64_t cols = 0;                // K
  // mxfp4: E8M0 bytes [E, N, K / 32]; nvfp4: E4M3 bytes [E, N, K / 16].
  const uint8_t* byte_scales = nullptr;
  // fp8_block: [E, ceil(N / block_rows), ceil(K / block_cols)].
  const float* float_scales = nullptr;
  int64_t block_rows = 1, block_cols = 1;
  // nvfp4: [E], each expert's scale of the whole matrix.
  const float* global_scales = nullptr;
  // How far past its loads a kernel prefetches the codes, in bytes (0: not at all): whole rows
  // ahead, the rows the next calls read (see prefetching).
  int64_t prefetch_bytes = 0;
  // The same rows ahead in the byte scales (0: not at all; see prefetch_row_scales).
  int64_t prefetch_scale_bytes = 0;

  int64_t code_bytes_per_row() const { return format == QuantFormat::kFp8Block ? cols : cols / 2; }
  const uint8_t* row_codes(int64_t expert, int64_t row) const {
    return codes + (expert * rows + row) * code_bytes_per_row();
  }
  int64_t scale_blocks_per_row() const {
    if (format == QuantFormat::kMxfp4) return cols / kMxfp4Block;
    if (format == QuantFormat::kNvfp4) return cols / kNvfp4Block;
    return (cols + block_cols - 1) / block_cols;
  }
  const uint8_t* row_byte_scales(int64_t expert, int64_t row) const {
    return byte_scales + (expert * rows + row) * scale_blocks_per_row();
  }
  const float* row_float_scales(int64_t expert, int64_t row) const {
    const int64_t block_row_count = (rows + block_rows - 1) / block_rows;
    return float_scales + (expert * block_row_count + row / block_rows) * scale_blocks_per_row();
  }
  float global_scale(int64_t expert) const { return global_scales ? global_scales[expert] : 1.0f; }
};

// m with the prefetch distances of rows read one after another set `rows_ahead` rows on (at most
// 32 KiB of codes; at least one row), or unset for rows_ahead 0.
inline QuantizedMatrix prefetching(QuantizedMatrix m, int64_t rows_ahead) {
  const int64_t row_bytes = m.code_bytes_per_row();
  m.prefetch_bytes = m.prefetch_scale_bytes = 0;
  if (rows_ahead <= 0 || row_bytes <= 0) return m;
  int64_t rows = rows_ahead * row_bytes <= (32 << 10) ? rows_ahead : (32 << 10) / row_bytes;
  rows = rows < 1 ? 1 : rows;
  m.prefetch_bytes = rows * row_bytes;
  if (m.byte_scales != nullptr) m.prefetch_scale_bytes = rows * m.scale_blocks_per_row();
  return m;
}

// Asks for the byte scales of the row prefetch_scale_bytes past the row whose scales start at
// `scales`, once per row.  The fp4 formats' scale rows are a stream of their own, a few dozen bytes
// a row, too slow for the hardware prefetchers to follow, which the codes' prefetch does not cover.
inline void prefetch_row_scales(const QuantizedMatrix& m, const uint8_t* scales) {
  if (m.prefetch_scale_bytes <= 0) return;
  const uint8_t* const first = scales + m.prefetch_scale_bytes;
  const int64_t count = m.scale_blocks_per_row();
  for (int64_t at = 0; at < count; at += 64) __builtin_prefetch(first + at, 0, 3);
  __builtin_prefetch(first + count - 1, 0, 3);  // the line of the last byte, where the row crosses one
}

// Vectors are padded with zeros to a multiple of this many floats (the widest kernels' lanes).
constexpr int64_t kQuantVectorPadding = 16;

// The dot products of one or two rows of expert `expert`'s matrix with `count` float vectors:
// out[r * count + v] = sum_k W[expert, rows[r], k] * vectors[v][k].  Each vector holds m.cols
// values and is readable, and zero, past them up to the next multiple of kQuantVectorPadding.
using QuantRowDots = void (*)(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                              const float* const* vectors, int count, float* out);

// The split layout of the vectors that split_dots takes (mxfp4 and nvfp4 only): each round of this
// many elements holds its even elements and then its odd ones, the order in which the codes' low
// and high nibbles decode, and the vectors are padded with zeros to whole rounds.
constexpr int64_t kQuantSplitRound = 32;

// The bfloat16 layouts that bf16_dots takes, for mxfp4 and for fp8_block with blocks a multiple of
// 64 wide (bf16_takes): vectors of bfloat16 bits padded with zeros to a multiple of this many
// elements, made of rounds of bf16_round(m) elements, each round's elements in the order in which
// the kernels decode a round's codes (bf16_layout_slot), so that they pair with them in bfloat16
// dot-product instructions.
constexpr int64_t kQuantBf16Padding = 128;

// Whether bf16_dots takes matrices like m (kernels that have one).
inline bool bf16_takes(const QuantizedMatrix& m) {
  return m.format == QuantFormat::kMxfp4 || (m.format == QuantFormat::kFp8Block && m.block_cols % 64 == 0);
}

// The elements of a round of m's bfloat16 layout: 128 for mxfp4 (64 code bytes, four scale
// blocks), 64 for fp8_block.  Both divide kQuantBf16Padding.
inline int64_t bf16_round(const QuantizedMatrix& m) { return m.format == QuantFormat::kMxfp4 ? 128 : 64; }

// Where element j (0 <= j < bf16_round(m)) of a round lies in m's bfloat16 layout: for mxfp4 the
// round's elements 0, 4, 8, ..., then 1, 5, 9, ..., then 2, 6, ... and 3, 7, ... (a 16-bit word of
// codes holds four, decoded one nibble position at a time); for fp8_block 8-element groups 0, 2, 4,
// 6 and then 1, 3, 5, 7 (byte unpacks pair the decoded bytes within 16-byte lanes).
inline int64_t bf16_layout_slot(const QuantizedMatrix& m, int64_t j) {
  if (m.format == QuantFormat::kFp8Block) return (j / 8 % 2) * 32 + (j / 16) * 8 + j % 8;
  return (j % 4) * 32 + j / 4;
}

// The most rows a QuantRowDotsBf16 call takes.
constexpr int kQuantMaxRows = 4;

// The dot products of QuantRowDots with vectors of bfloat16 bits in the bfloat16 layout, for one to
// kQuantMaxRows rows; the products are exact (E2M1 values times bfloat16 values), the sums float32.
using QuantRowDotsBf16 = void (*)(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                                  const uint16_t* const* vectors, int count, float* out);

struct QuantKernels {
  QuantRowDots dots;
  const char* name;  // "portable", "avx2", "avx512" or "avx512_bf16"
  QuantRowDots split_dots;  // dots with vectors in the split layout, or nullptr where there are none
  // dots with bfloat16 vectors (kQuantBf16Padding) for matrices bf16_takes, or nullptr where there
  // are none: taken for vectors that are exactly bfloat16 (bfloat16 tokens)
  QuantRowDotsBf16 bf16_dots = nullptr;
};

// The portable kernels, always available (plain loops over the byte tables).
const QuantKernels& portable_quant_kernels();

// The AVX2 + FMA + F16C kernels, or nullptr when this build or this CPU has none.
const QuantKernels* avx2_quant_kernels();

// The AVX-512 (F, BW, VL) kernels, or nullptr when this build or this CPU has none.
const QuantKernels* avx512_quant_kernels();

// The AVX-512 kernels plus bf16_dots on AVX512-BF16's dot products (and VBMI's byte permutes), or
// nullptr when this build or this CPU has none.
const QuantKernels* avx512_bf16_quant_kernels();

// The widest kernels this CPU runs.
const QuantKernels& best_quant_kernels();

// Elements [k0, k0 + len) of row `row` of expert `expert`'s matrix, each W's value as the format
// defines it (nvfp4's global scale included, in float32), into w: the portable kernels' decoding,
// plain loops over the byte tables.
void decode_row_values(const QuantizedMatrix& m, int64_t expert, int64_t row, int64_t k0, int64_t len, float* w);

// The unit between the two products.
enum class ExpertActivation : int {
  kGated = 0,     // gate and up rows: GatedUnit's (SwiGLU, gpt-oss' clamped unit)
  kGelu = 1,      // up rows only: u * Phi(u) (erf)
  kGeluTanh = 2,  // up rows only: GELU's tanh approximation
  kRelu = 3,      // up rows only: max(u, 0)
};

struct ExpertUnit {
  ExpertActivation activation = ExpertActivation::kGated;
  GatedUnit gated{1.0, 0.0, false, 0.0, false};  // kGated's parameters; `interleaved` also places the rows
};

template <class T>
struct QuantizedDecodeCall {
  const T* x = nullptr;             // [tokens, hidden], row stride x_stride
  int64_t x_stride = 0;
  const int64_t* expert_ids = nullptr;  // [tokens, k]
  const float* weights = nullptr;       // [tokens, k], or nullptr for weight 1
  int64_t tokens = 0, k = 0, experts = 0;
  int64_t hidden = 0;   // H: gate_up's K
  int64_t inter = 0;    // I: down's K; gate_up holds 2I rows (gated) or I
  int64_t outputs = 0;  // O: down's N
  QuantizedMatrix gate_up, down;
  const float* gate_up_bias = nullptr;  // [E, gate_up.rows], laid out like the rows, or nullptr
  const float* down_bias = nullptr;     // [E, outputs], or nullptr
  ExpertUnit unit;
  T* out = nullptr;  // [tokens, outputs], contiguous
};

// Runs the call with `kernels` (threads over the items of each pass).
template <class T>
void decode_quantized_experts(const QuantizedDecodeCall<T>& call, const QuantKernels& kernels);

// An up-only unit's value at u, in float32, whichever kernels computed u (the gated units take
// gated_forward_here, as the grouped path does).
float up_only_unit_value(ExpertActivation activation, float u);

}  // namespace core
}  // namespace tutel
